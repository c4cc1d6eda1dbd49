"""The model zoo: contract, small-size training steps, paper-size structure on meta."""
import math

import pytest
import torch
import torch.fx
import torch.nn as nn

from flexflow import models

NAMES = ["lenet", "alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt", "transformer"]
RECURRENT = {"rnntc": 4, "rnnlm": 2, "nmt": 4}  # LSTMCell modules at any size


def _count(module, cls):
    return sum(isinstance(m, cls) for m in module.modules())


def _loss(module, inputs, seed=1234):
    # Dropout draws from the global RNG: pin it for a comparable forward.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return module(*inputs)


def test_names_contract():
    assert models.names() == NAMES + ["gpt2", "llama"]  # the decoders: tests/test_llm_zoo.py


def test_bad_arguments():
    with pytest.raises(ValueError, match="vgg16") as e:
        models.get("vgg16")
    assert "resnet101" in str(e.value)  # lists the valid names
    with pytest.raises(ValueError, match="huge"):
        models.get("lenet", size="huge")
    for bad in (0, -4, 2.5):
        with pytest.raises(ValueError, match="batch_size"):
            models.get("lenet", batch_size=bad, size="small")


@pytest.mark.parametrize("name", NAMES)
def test_small_training_step(name):
    rng = torch.random.get_rng_state()
    module, inputs = models.get(name, batch_size=3, size="small", seed=7)
    assert torch.equal(rng, torch.random.get_rng_state()), "get() disturbed the global RNG"
    assert isinstance(inputs, tuple) and all(t.shape[0] == 3 for t in inputs)
    assert module.training
    loss = _loss(module, inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in module.named_parameters():
        assert p.grad is not None, f"{name}: no gradient for {pname}"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient for {pname}"

    # Same seed: same weights, inputs and loss; another seed: other inputs.
    again, inputs2 = models.get(name, batch_size=3, size="small", seed=7)
    assert all(torch.equal(a, b) for a, b in zip(inputs, inputs2))
    sd, sd2 = module.state_dict(), again.state_dict()
    assert sd.keys() == sd2.keys()
    # BN running stats moved in the forward above: compare parameters only.
    for k, p in module.named_parameters():
        assert torch.equal(p, sd2[k]), f"{name}: {k} differs for the same seed"
    assert torch.equal(_loss(again, inputs2), loss.detach())
    _, inputs3 = models.get(name, batch_size=3, size="small", seed=8)
    assert any(not torch.equal(a, b) for a, b in zip(inputs, inputs3))


@pytest.mark.parametrize("name", NAMES)
def test_small_traces_with_fx(name):
    module, inputs = models.get(name, batch_size=2, size="small")
    gm = torch.fx.symbolic_trace(module)
    assert torch.equal(_loss(gm, inputs), _loss(module, inputs))
    for node in gm.graph.nodes:  # no in-place ops on activations
        if node.op == "call_method":
            assert not node.target.endswith("_"), f"{name}: in-place {node.target}"
        assert node.kwargs.get("inplace") is not True, f"{name}: in-place {node}"
        if node.op == "call_module":
            sub = gm.get_submodule(node.target)
            assert not getattr(sub, "inplace", False), f"{name}: in-place {node.target}"


def test_default_batch_and_dtype():
    _, (x, y) = models.get("alexnet", device="meta")
    assert x.shape == (256, 3, 224, 224)
    _, (x, y) = models.get("lenet", size="small")
    assert x.shape[0] == 8 and y.dtype == torch.int64
    module, (x, y) = models.get("lenet", batch_size=2, size="small", dtype=torch.bfloat16)
    assert x.dtype == torch.bfloat16 and module.fc1.weight.dtype == torch.bfloat16
    assert module(x, y).dtype == torch.bfloat16


@pytest.mark.parametrize("name", NAMES)
def test_paper_size_on_meta(name):
    module, inputs = models.get(name, batch_size=512, device="meta")
    assert all(t.device.type == "meta" for t in inputs)
    assert all(p.device.type == "meta" for p in module.parameters())
    assert all(t.shape[0] == 512 for t in inputs)
    if name in RECURRENT:
        assert module.steps == 40
        assert _count(module, nn.LSTMCell) == RECURRENT[name]
        assert all(t.shape[1] == 40 for t in inputs if t.dim() == 2)
        assert all(t.dtype == torch.int64 for t in inputs)
    # A forward pass on meta checks every paper-size shape; nothing is allocated.
    loss = module(*inputs)
    assert loss.dim() == 0 and loss.device.type == "meta"


def test_paper_structure():
    m, (x, _) = models.get("inception_v3", batch_size=512, device="meta")
    assert _count(m, nn.Conv2d) >= 94 and x.shape == (512, 3, 299, 299)
    m, (x, _) = models.get("resnet101", batch_size=512, device="meta")
    assert _count(m, nn.Conv2d) >= 100 and x.shape == (512, 3, 224, 224)
    m, (x, _) = models.get("alexnet", batch_size=512, device="meta")
    assert _count(m, nn.Conv2d) == 5 and _count(m, nn.Linear) == 3
    assert x.shape == (512, 3, 224, 224)
    m, (tok, tgt) = models.get("transformer", batch_size=4, device="meta")
    assert len(m.blocks) == 12 and tok.shape == tgt.shape == (4, 1024)
    assert m.config.width == 768 and m.config.heads == 12 and m.config.vocab == 50257
    cfg = models.config("rnnlm")
    assert (cfg.vocab, cfg.hidden, cfg.embed, cfg.steps) == (10000, 1024, 1024, 40)
    # Parameter counts of the standard networks (millions).
    for name, millions in [("alexnet", 61.1), ("inception_v3", 23.8),
                           ("resnet101", 44.5), ("transformer", 124.4)]:
        m, _ = models.get(name, device="meta")
        n = sum(p.numel() for p in m.parameters()) / 1e6
        assert math.isclose(n, millions, abs_tol=0.1), (name, n)


@pytest.mark.parametrize("name", NAMES)
def test_small_keeps_structure(name):
    small, _ = models.get(name, size="small", device="meta")
    paper, _ = models.get(name, device="meta")
    if name == "transformer":  # 2 of the 12 identical blocks at the small size
        assert len(small.blocks) == 2
        small, paper = small.blocks[0], paper.blocks[0]
    for cls in (nn.Conv2d, nn.Linear, nn.LSTMCell, nn.BatchNorm2d, nn.LayerNorm, nn.Embedding):
        assert _count(small, cls) == _count(paper, cls), (name, cls.__name__)
    if name in RECURRENT:
        assert small.steps == 4
