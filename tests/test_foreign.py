"""Model families the project does not own, as their libraries ship them
(random init from small configs, no downloads): Hugging Face GPT-2, LLaMA
(grouped-query attention, rotary embeddings), BERT, T5, BART; timm ViT,
ConvNeXt, Swin, EfficientNet, MobileNetV3; torchvision classifiers.

Each family traces (op by op equal to the module under random strategies),
searches on 2 CPU devices and on 8 simulated H200s (never worse than data
parallelism), and trains 2 SGD steps on 2 gloo processes with a searched and
a random strategy equal to one process.  Needs the optional libraries
(``make test-ext``); without them every test here is skipped.
"""
import importlib.util

import pytest
import torch

import flexflow as ff
from flexflow.strategy.localrun import run_graph

import _foreign as Fo

TOL = 1e-5
# ops that stay opaque, and why (docs/libraries.md)
ALLOWED_OPAQUE = {
    "gpt2": set(), "llama": set(),
    "bert": {"index"},  # the padding mask gathered with absolute batch indices
    "t5": {"new_zeros", "write_into"}, "bart": {"new_zeros", "write_into"},  # shift_tokens_right
    "vit": {"expand"},  # the class token (a parameter) expanded to the batch
    "convnext": {"reshape"},  # layer scale (a parameter) reshaped
    "swin": {"getitem"},  # relative position bias gathered by index
    "efficientnet": set(), "mobilenetv3": set(),
    "tv_resnet18": set(), "tv_mobilenet_v3_small": set(),
    "tv_convnext_tiny": {"stochastic_depth"},  # torchvision's function: split by samples, proven at capture
}
BATCH_NORM = {"efficientnet", "mobilenetv3", "tv_resnet18", "tv_mobilenet_v3_small"}


def _have(lib: str) -> bool:
    return importlib.util.find_spec(lib) is not None


def _need(name):
    lib = Fo.FAMILIES[name]
    if not _have(lib):
        pytest.skip(f"{lib} is not installed (make test-ext)")


@pytest.fixture(scope="module")
def traced():
    cache = {}

    def get(name):
        if name not in cache:
            module, args, kwargs = Fo.build(name, 8)
            module.train(name not in BATCH_NORM)  # BatchNorm: running statistics, exact under any split
            cache[name] = (module, args, kwargs, ff.trace(module, args, kwargs))
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(Fo.FAMILIES))
def test_traces_and_equals_module(traced, name):
    _need(name)
    module, args, kwargs, graph = traced(name)
    opaque = {graph.op(n).kind for n in graph.opaque}
    assert opaque <= ALLOWED_OPAQUE[name], f"{name}: opaque {opaque - ALLOWED_OPAQUE[name]}"
    ref = module(*args, **kwargs)
    machine = ff.Machine.preset("h200-node", devices=4)
    for seed in range(3):
        out = run_graph(graph, module, graph.flat_inputs(args, kwargs), ff.Strategy.random(graph, machine, seed))
        assert type(out) is type(ref)
        if Fo.FAMILIES[name] == "transformers":
            torch.testing.assert_close(out.loss, ref.loss, rtol=TOL, atol=1e-6)
            out, ref_t = out.logits, ref.logits
        else:
            ref_t = ref
        torch.testing.assert_close(out, ref_t, rtol=TOL, atol=1e-6)


@pytest.mark.parametrize("name", list(Fo.FAMILIES))
@pytest.mark.parametrize("preset,devices", [("cpu", 2), ("h200-node", 8)])
def test_search_never_worse_than_data_parallel(traced, name, preset, devices):
    _need(name)
    graph = traced(name)[3]
    res = ff.search(graph, ff.Machine.preset(preset, devices=devices), budget=1.0, seed=0)
    dp = res.baselines["data_parallel"].iteration_time
    assert res.result.iteration_time <= dp * (1 + 1e-9)


@pytest.fixture(scope="module")
def trained():
    names = [n for n in Fo.FAMILIES if _have(Fo.FAMILIES[n])]
    if not names:
        pytest.skip("none of transformers, timm, torchvision is installed (make test-ext)")
    specs = {n: (["searched@eval", "bnchannel:1"] if n in BATCH_NORM else ["searched", "random:1"])
             for n in names}
    return ff.launch(Fo.train_equal, 2, names, specs, timeout_s=1500)


@pytest.mark.parametrize("name", list(Fo.FAMILIES))
def test_trains_equal_to_one_process(trained, name):
    _need(name)
    recs = [r for r in trained[0] if r["model"] == name]
    assert len(recs) == 2
    for rec in recs:
        where = f"{name} {rec['spec']}"
        assert rec["keys_match"], where
        assert rec["loss_err"] <= TOL, f"{where}: loss err {rec['loss_err']:.2e}"
        assert rec["param_err"] <= TOL, f"{where}: {rec['worst']} err {rec['param_err']:.2e}"
        other = next(o for o in trained[1] if o["model"] == name and o["spec"] == rec["spec"])
        assert other["losses"] == rec["losses"], f"{where}: ranks disagree"
    assert any(r["exchanges"] > 0 for r in recs), f"{name}: no strategy moved data between ranks"


class _TransposedLoss(torch.nn.Module):
    """The causal LM with the loss written as the zoo writes it, outside the model."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        logits = self.model(input_ids=input_ids).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:])


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_causal_lm_with_labels_is_data_parallel_everywhere(name):
    """Hugging Face's own loss (labels shifted, then flattened) keeps the batch: under data
    parallelism on 8 H100s no op runs whole, and each device's predicted peak is within 10%
    of the same model with the loss written over a transposed (B, V, T) input."""
    _need(name)
    module, args, kwargs = Fo.build(name, 16)
    machine = ff.Machine.preset("h100-node")
    graph = ff.trace(module, args, kwargs)
    s = ff.Strategy.data_parallel(graph, machine)
    whole = [op.name for op in graph.compute_ops if len(s[op.name].devices) == 1]
    assert not whole, (whole, graph.whole_reasons)
    peak = ff.Simulator(graph, machine).simulate(s).peak_memory
    ref_graph = ff.trace(_TransposedLoss(module), (kwargs["input_ids"], kwargs["labels"]))
    ref = ff.Simulator(ref_graph, machine).simulate(ff.Strategy.data_parallel(ref_graph, machine)).peak_memory
    assert max(peak) <= 1.1 * max(ref) and min(peak) >= 0.9 * min(ref), (peak, ref)
    assert max(peak) - min(peak) <= 0.1 * max(peak)
