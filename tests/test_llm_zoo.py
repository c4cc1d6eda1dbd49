"""Today's decoders in the zoo: GPT-2 and LLaMA 3 at their model cards' sizes, small
sizes that train here, meta builds for planning, fused attention, their activation memory
against the published per-layer formula and against PyTorch's MemTracker, and the
command line's --size, --seq and tokens/s per device."""
import dataclasses
import json
import math
import os
import sys

import pytest
import torch

import flexflow as ff
from flexflow import models
from flexflow.cli import main
from flexflow.models.gpt2 import GPT2, gpt2_config
from flexflow.models.llama import Llama, llama_config
from flexflow.sim.simulate import Simulator
from flexflow.strategy.localrun import run_graph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from memory_accuracy import measured_peak, predicted_peak


def test_names_and_sizes():
    names = models.names()
    assert names[-2:] == ["gpt2", "llama"] and len(names) == len(set(names)) == 10
    assert models.sizes("gpt2") == ("paper", "small", "124m", "350m", "774m", "1.5b")
    assert models.sizes("llama") == ("paper", "small", "1b", "8b", "70b")
    assert models.sizes("lenet") == ("paper", "small")


@pytest.mark.parametrize("name,size,millions,shape", [
    ("gpt2", "124m", 124.4, (12, 768, 12)), ("gpt2", "350m", 354.8, (24, 1024, 16)),
    ("gpt2", "774m", 774.0, (36, 1280, 20)), ("gpt2", "1.5b", 1557.6, (48, 1600, 25)),
    ("llama", "1b", 1235.8, (16, 2048, 32)), ("llama", "8b", 8030.3, (32, 4096, 32)),
    ("llama", "70b", 70553.7, (80, 8192, 64))])
def test_model_card_sizes_on_meta(name, size, millions, shape):
    module, (tok, tgt) = models.get(name, batch_size=2, size=size, device="meta")
    assert all(p.device.type == "meta" for p in module.parameters())
    cfg = module.config
    assert (cfg.layers, cfg.width, cfg.heads) == shape
    assert math.isclose(sum(p.numel() for p in module.parameters()) / 1e6, millions, abs_tol=0.1)
    assert tok.shape == tgt.shape == (2, 1024 if name == "gpt2" else 8192) and tok.dtype == torch.int64
    if name == "llama":
        assert cfg.kv_heads == 8 and cfg.vocab == 128256 and cfg.tie_embeddings == (size == "1b")
        assert cfg.hidden == {"1b": 8192, "8b": 14336, "70b": 28672}[size]
    else:
        assert cfg.vocab == 50257
    assert models.get(name, size=size, device="meta")[0].config == models.config(name, size)


def test_paper_size_is_gpt2_124m_and_llama_8b_and_seq_len():
    assert models.config("gpt2") == models.config("gpt2", "124m")
    assert models.config("llama") == models.config("llama", "8b")
    module, (tok, _) = models.get("llama", batch_size=3, seq_len=4096, device="meta")
    assert tok.shape == (3, 4096) and module.cos.shape[0] == 4096
    loss = module(tok, tok)  # every paper-size shape checked on meta, nothing allocated
    assert loss.dim() == 0 and loss.device.type == "meta"
    long, (tok, _) = models.get("gpt2", batch_size=1, seq_len=2048, device="meta")
    assert tok.shape == (1, 2048) and long.wpe.num_embeddings == 2048  # positions grow with it
    assert models.paper_batch("gpt2") == 16 and models.paper_batch("llama", "small") == 8


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(ValueError, match="'13b'.*1b, 8b, 70b"):
        models.get("llama", size="13b")
    with pytest.raises(ValueError, match="seq_len.*gpt2 and llama.*'lenet'"):
        models.get("lenet", seq_len=32)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="seq_len"):
            models.get("gpt2", size="small", seq_len=bad)
    with pytest.raises(ValueError, match="'124m'"):
        models.get("transformer", size="124m")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_small_trains_traces_and_equals_the_module(name):
    module, inputs = models.get(name, batch_size=3, size="small", seq_len=12, seed=5)
    assert inputs[0].shape == (3, 12)
    loss = module(*inputs)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in module.parameters())
    again, inputs2 = models.get(name, batch_size=3, size="small", seq_len=12, seed=5)
    assert torch.equal(again(*inputs2), loss.detach())
    graph = ff.trace(module, inputs)
    kinds = {op.kind for op in graph.ops}
    assert not graph.opaque and "attention" in kinds and "matmul" not in kinds  # fused: no s x s product
    att = [op for op in graph.ops if op.kind == "attention"]
    assert len(att) == module.config.layers and all(op.attrs["is_causal"] for op in att)
    if name == "llama":
        norms = [op for op in graph.ops if op.kind == "rms_norm"]
        assert len(norms) == 2 * module.config.layers + 1 and all(op.rule == "rowwise" for op in norms)
        assert {"silu", "cat", "neg"} <= kinds  # SwiGLU, rotary positions
        assert all(op.attrs["kv_heads"] == op.attrs["q_heads"] for op in att)  # keys repeated to the heads
    machine = ff.Machine.preset("h100-node", devices=4)
    dp = Simulator(graph, machine).simulate(ff.Strategy.data_parallel(graph, machine))
    assert dp.comm_bytes == 0  # every op splits by samples (GPT-2's q, k, v pieces of one product too)
    ref = module(*inputs)
    for seed in range(3):
        torch.testing.assert_close(run_graph(graph, module, inputs, ff.Strategy.random(graph, machine, seed)), ref)


def _layer_bytes(cls, cfg, seq, precision="bf16-true"):
    """Activation bytes of one block at micro-batch 4 under ``precision``, from the simulated
    peaks: (3 blocks - 2 blocks) at batch 8 less the same at batch 4 (parameters cancel)."""
    m = ff.Machine.preset("h100-node", devices=1).with_memory(10**15)
    peak = {}
    for layers in (2, 3):
        c = dataclasses.replace(cfg, layers=layers, seq_len=seq)
        with torch.device("meta"):
            module = cls(c)
        for b in (4, 8):
            x = torch.zeros(b, seq, dtype=torch.int64, device="meta")
            g = ff.trace(module, (x, x))
            peak[layers, b] = Simulator(g, m, precision=precision).simulate(
                ff.Strategy.data_parallel(g, m)).peak_memory[0]
    return (peak[3, 8] - peak[3, 4]) - (peak[2, 8] - peak[2, 4])


@pytest.mark.slow
def test_activation_memory_is_the_published_per_layer_formula():
    """Korthikanti et al. 2022: s*b*h*(34 + 5*a*s/h) bytes a layer; fused attention drops the
    a*s^2 terms and, without dropout, the two 1-byte masks: 32*s*b*h for GPT-2.  LLaMA's block
    keeps its two norms' inputs and outputs (8sbh), q, k and v at all heads and the attention's
    output (8sbh) and the SwiGLU's four f-wide tensors (8*s*b*f).  The formula is for a
    module in 16 bits (Megatron's), here bf16-true; under torch.autocast (bf16-mixed) the
    residual stream stays float32, so each of GPT-2's two LayerNorms saves a 4-byte input
    instead of a 2-byte one: 36*s*b*h."""
    s, b = 512, 4
    for size in ("124m", "1.5b"):
        cfg = gpt2_config(size)
        assert _layer_bytes(GPT2, cfg, s) == 32 * s * b * cfg.width
        assert _layer_bytes(GPT2, cfg, s, "bf16-mixed") == 36 * s * b * cfg.width
    cfg = llama_config("1b")
    assert _layer_bytes(Llama, cfg, s) == s * b * (16 * cfg.width + 8 * cfg.hidden)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_peak_memory_against_memtracker(name):
    """One training step of the small model on this CPU, measured by MemTracker, against the
    simulator on the cpu preset (where ``F.rms_norm`` runs unfused and keeps x * rstd, a
    tensor the fused GPU kernel does not keep: the simulator counts it on CPU devices only)."""
    module, inputs = models.get(name, size="small", batch_size=4, seq_len=64)
    graph = ff.trace(module, inputs)
    for optimizer in ("sgd", "adam"):
        measured = measured_peak(module, inputs, optimizer)
        predicted = predicted_peak(graph, 1, optimizer)
        assert predicted == pytest.approx(measured, rel=0.02), (optimizer, predicted, measured)
    if name == "llama":  # not on a GPU
        gpu = ff.Machine.preset("h100-node", devices=1)
        cpu = ff.Machine.preset("cpu", devices=1).with_memory(gpu.devices[0].spec.memory_bytes)
        unfused = sum(math.prod(op.output_shape) * 4 for op in graph.ops if op.kind == "rms_norm")
        peaks = [ff.Simulator(graph, m, optimizer="sgd").simulate(ff.Strategy.data_parallel(graph, m)).peak_memory[0]
                 for m in (cpu, gpu)]
        assert 0 < peaks[0] - peaks[1] <= unfused


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_command_line_size_seq_and_tokens_per_device(capsys):
    code, out, _ = run(capsys, "simulate", "gpt2", "--size", "small", "--seq", "32", "--batch", "8",
                       "--machine", "h100-node", "--devices", "4", "--precision", "bf16-mixed", "--json")
    d = json.loads(out)
    assert code == 0 and d["model"] == "gpt2-small" and d["devices"] == 4
    tokens = 8 * 32 / (d["iteration_time_ms"] / 1e3) / 4
    assert d["tokens_per_s_per_device"] == pytest.approx(tokens) and 0 < d["mfu"] < 1
    assert {"throughput", "comm_bytes", "sync_bytes", "peak_memory_bytes"} <= set(d)
    code, out, _ = run(capsys, "simulate", "llama", "--size", "small", "--machine", "h100-cluster", "--devices", "16")
    assert code == 0 and "tokens/s per device" in out and "MFU" in out
    code, out, _ = run(capsys, "simulate", "lenet", "--machine", "p100-cluster", "--devices", "4")
    assert code == 0 and "tokens/s" not in out  # images in: no tokens
    code, out, _ = run(capsys, "search", "llama", "--size", "small", "--seq", "16", "--machine", "h100-node",
                       "--budget", "1", "--json")
    d = json.loads(out)
    assert code == 0 and d["tokens_per_s_per_device"] > 0
    assert all(r["tokens_per_s_per_device"] > 0 and "iteration_time_ms" in r for r in d["baselines"].values())
    code, out, _ = run(capsys, "trace", "llama", "--size", "small", "--seq", "8", "--json")
    assert code == 0 and json.loads(out)["model"] == "llama-small" and json.loads(out)["opaque"] == []
    for argv, needle in [(("trace", "lenet", "--seq", "8"), "--seq applies to gpt2 and llama"),
                         (("trace", "gpt2", "--size", "7b"), "'7b'"),
                         (("simulate", "gpt2", "--size", "small", "--seq", "0", "--machine", "h100-node"), "--seq")]:
        code, _, err = run(capsys, *argv)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
