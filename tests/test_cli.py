"""The command line: contract output and one-line errors."""
import json
import subprocess
import sys

import pytest

from flexflow.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_models(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0 and out.split() == ["lenet", "alexnet", "inception_v3", "resnet101", "rnntc",
                                         "rnnlm", "nmt", "transformer", "gpt2", "llama"]


def test_trace_table_and_summary(capsys):
    code, out, _ = run(capsys, "trace", "lenet")
    assert code == 0
    assert "conv1" in out and "conv2d" in out and "64x20x24x24" in out
    assert "strategy space on 4 devices: 10^" in out and "opaque ops: none" in out
    code, out, _ = run(capsys, "trace", "lenet", "--batch", "8", "--json")
    d = json.loads(out)
    assert d["ops"] == 11 and d["table"][2]["shape"] == "8x20x24x24"
    assert set(d["log10_strategies"]) == {"4", "16"}


def test_user_model_file(tmp_path, capsys):
    f = tmp_path / "mymodel.py"
    f.write_text(
        "import torch, torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc = nn.Linear(4, 3)\n"
        "    def forward(self, x):\n"
        "        return torch.special.erfcx(self.fc(x)).sum()\n"
        "def build():\n"
        "    return M(), (torch.randn(5, 4),)\n")
    code, out, _ = run(capsys, "trace", f"{f}:build")
    assert code == 0 and "opaque ops: special_erfcx" in out


@pytest.mark.parametrize("argv,needle", [
    (("trace", "nosuchmodel"), "unknown model 'nosuchmodel'"),
    (("trace", "missing.py:build"), "model file 'missing.py' does not exist"),
    (("simulate", "lenet", "--machine", "tpu-pod"), "tpu-pod"),
    (("simulate", "lenet", "--machine", "p100-cluster", "--devices", "99"), "devices=99"),
    (("search", "lenet", "--machine", "p100-cluster", "--devices", "4", "--exhaustive", "--max-states", "10"),
     "max_states=10"),
    (("simulate", "lenet", "--machine", "p100-cluster", "--strategy", "zero9"), "not a built-in"),
    (("simulate", "llama", "--size", "small", "--batch", "1", "--machine", "h100-cluster", "--devices", "16",
      "--strategy", "megatron"), "--strategy megatron: megatron with tp=8 on 16 devices"),
])
def test_errors_are_one_line(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "flexflow.cli", "models"], capture_output=True, text=True)
    assert r.returncode == 0 and "transformer" in r.stdout


def _machine_file(tmp_path, memory_bytes):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({
        "name": "tiny", "nodes": 1, "devices_per_node": 2,
        "device": {"kind": "P100", "peak_flops": {"float32": 1.06e13}, "mem_bw_Bps": 7.3e11,
                   "memory_bytes": memory_bytes},
        "intra_node": {"bandwidth_Bps": 2e10, "latency_s": 5e-6, "kind": "nvlink"}}))
    return str(f)


def test_search_prints_memory_per_device_and_refuses_when_nothing_fits(tmp_path, capsys):
    argv = ("search", "lenet", "--batch", "16", "--evaluations", "30", "--optimizer", "adam")
    code, out, _ = run(capsys, *argv, "--machine", _machine_file(tmp_path, 16 * 2**30))
    assert code == 0 and "memory per device 0" in out and "(of 17.2 GB)" in out
    out_file = tmp_path / "s.json"
    code, out, err = run(capsys, *argv, "--machine", _machine_file(tmp_path, 2**20), "--out", str(out_file))
    assert code == 2 and "no strategy fits device memory (optimizer adam" in err
    assert "out of memory on device" in err and len(err.strip().splitlines()) == 1
    assert not out_file.exists()


def test_calibration_is_printed_in_words():
    """`flexflow profile --comm` prints the figures and the executor fit's cases, not a dict."""
    from flexflow.cli import _calibration_text
    res = {"nprocs": 2, "cores": 2, "seconds": 12.0, "path": "/x/machine-cpu.json",
           "peak_flops": {"float32": 1.5e11}, "mem_bw_Bps": 2e10, "launch_overhead_s": 3e-6,
           "latency_s": 4e-5, "bandwidth_Bps": 2.5e9, "exchange_s": 1.7e-4, "allreduce_latency_s": 8e-4,
           "allreduce_bandwidth_Bps": 1.2e9, "sync_skew": 0.1, "output_sync_s": 1.3e-3,
           "micro": {"exchange_s": 1.4e-4, "bandwidth_Bps": 5e9, "allreduce_latency_s": 3e-4, "sync_skew": 0.2},
           "fit": {"measured_ms": {"alternate@64x32": 4.6}, "predicted_ms": {"alternate@64x32": 4.5},
                   "error": {"alternate@64x32": -0.0217}}}
    text = _calibration_text(res)
    assert "a message between compute: 170 us + 2.50 GB/s" in text
    assert "800 us per ring step" in text and "returning the loss to every rank: 1300 us" in text
    assert "the micro-benchmarks said a message 140 us" in text
    assert "alternate@64x32" in text and "-2.2%" in text and "{" not in text
    del res["micro"], res["fit"], res["output_sync_s"]
    res["fit_error"] = "RuntimeError: boom"
    text = _calibration_text(res)
    assert "idle ping-pong: 40 us + 2.50 GB/s" in text and "fit failed" in text and "boom" in text


def test_simulate_takes_the_sharded_baselines_and_block_recomputation(capsys):
    base = ("simulate", "llama", "--size", "small", "--seq", "256", "--batch", "64", "--machine", "h100-cluster",
            "--devices", "8", "--precision", "bf16-mixed", "--optimizer", "adam", "--json")
    peaks = {}
    for strategy in ("data_parallel", "zero1", "zero2", "fsdp", "megatron", "fsdp_tp"):
        code, out, _ = run(capsys, *base, "--strategy", strategy)
        assert code == 0, strategy
        peaks[strategy] = max(json.loads(out)["peak_memory_bytes"])
    assert peaks["fsdp"] < peaks["zero2"] < peaks["zero1"] < peaks["data_parallel"]
    code, out, _ = run(capsys, *base, "--strategy", "fsdp", "--recompute", "blocks")
    d = json.loads(out)
    assert code == 0 and d["strategy"] == "fsdp (blocks recomputed)"
    # (q, k and v share one bfloat16 copy of their input, gate and up another: what block
    # recomputation drops is 7% of this small model's peak, where the logits dominate)
    assert max(d["peak_memory_bytes"]) < 0.95 * peaks["fsdp"]


def test_simulate_native_prints_the_plan_in_torchs_terms(capsys):
    base = ("simulate", "llama", "--size", "small", "--batch", "8", "--machine", "h100-cluster", "--devices", "8",
            "--strategy", "fsdp_tp", "--tp", "2", "--pp", "2", "--microbatches", "2", "--native")
    code, out, _ = run(capsys, *base)
    assert code == 0
    assert "mesh: dp_shard=2 x pp=2 x tp=2" in out and "every layers.*:" in out
    assert "SequenceParallel()" in out and "stage 1: layers.1, norm, output" in out
    code, out, _ = run(capsys, *base, "--json")
    native = json.loads(out)["native"]
    assert native["pipeline"]["schedule"] == "Schedule1F1B" and native["parallelism"]["tensor_parallel_degree"] == 2
    code, _, err = run(capsys, "simulate", "llama", "--size", "small", "--batch", "8", "--machine", "h100-cluster",
                       "--devices", "4", "--strategy", "zero1", "--native")
    assert code == 2 and "shard level 1" in err


def test_simulate_shapes_megatron_with_context_and_without_sequence_parallelism(capsys):
    base = ("simulate", "llama", "--size", "small", "--seq", "256", "--batch", "4", "--machine", "h100-cluster",
            "--devices", "8", "--strategy", "megatron", "--json")
    got = {}
    for extra in (("--tp", "4"), ("--tp", "4", "--cp", "2"), ("--tp", "4", "--cp", "2", "--cp-contiguous"),
                  ("--tp", "8"), ("--tp", "8", "--no-sequence-parallel")):
        code, out, _ = run(capsys, *base, *extra)
        assert code == 0, extra
        got[extra] = json.loads(out)["comm_bytes"]
    assert got[("--tp", "4", "--cp", "2")] != got[("--tp", "4")]  # (the keys and values move besides)
    # balanced, every chunk gathers all the keys and values; contiguous, only those before it
    assert got[("--tp", "4", "--cp", "2", "--cp-contiguous")] < got[("--tp", "4", "--cp", "2")]
    assert got[("--tp", "8", "--no-sequence-parallel")] != got[("--tp", "8")]
    code, _, err = run(capsys, *base, "--tp", "4", "--no-sequence-parallel")
    assert code == 2 and "sequence_parallel=False" in err and "tp=4" in err
    code, _, err = run(capsys, *base[:-3], "--strategy", "fsdp", "--cp", "2")
    assert code == 2 and "--cp" in err
