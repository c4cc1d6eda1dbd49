"""examples/train_lm.py on 2 gloo processes: AdamW + warmup/cosine + clipping +
accumulation, and a torch.distributed.checkpoint checkpoint/resume that continues
with the same losses (and on one process, under another strategy, close to them)."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import flexflow as ff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_lm.py")
# A tiny LM (transformer small: 2 layers, width 32, seq 16, vocab 64), batch 4.
COMMON = ["--model", "transformer", "--size", "small", "--batch", "4", "--nprocs", "2",
          "--accum", "2", "--clip", "0.5", "--lr", "3e-3", "--warmup", "2", "--log-every", "1"]


def _run(tmp_path, *extra):
    cmd = [sys.executable, SCRIPT, *COMMON, *extra]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def _train(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    r = _run(tmp_path, "--losses-out", str(out), *extra)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(out.read_text()), r.stdout


@pytest.fixture
def strategy_file(tmp_path):
    # A fixed (random, sharding) strategy: the uninterrupted and the checkpointed run
    # must run the same one (a search is timed, so it could pick another), and a
    # sharded one makes each rank's optimizer state differ.
    module, inputs = ff.models.get("transformer", size="small", batch_size=4)
    graph = ff.trace(module, inputs)
    strategy = ff.Strategy.random(graph, ff.Machine.preset("p100-cluster", devices=2), seed=3)
    path = tmp_path / "strategy.json"
    path.write_text(strategy.to_json())
    return str(path)


def _model(ckpt_dir):
    """The latest checkpoint's model, loaded into the plain module (no process group)."""
    with open(os.path.join(ckpt_dir, "latest")) as f:
        folder = os.path.join(ckpt_dir, f.read().strip())
    module, _ = ff.models.get("transformer", size="small", batch_size=4, seed=9)
    state = {"model": module.state_dict()}
    dcp.load(state, checkpoint_id=folder)
    module.load_state_dict(state["model"])
    return module.state_dict()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_resume_continues_with_the_same_losses(tmp_path, strategy_file):
    full_dir, part_dir = str(tmp_path / "full"), str(tmp_path / "part")
    full, log = _train(tmp_path, "full", "--steps", "6", "--strategy", strategy_file,
                       "--ckpt-dir", full_dir, "--ckpt-every", "100")
    assert full["start"] == 0 and len(full["losses"]) == 6
    assert "grad-norm" in log and "tokens/s" in log and "lr" in log

    # The same 6-step schedule, stopped after step 3 with a checkpoint there.
    first, _ = _train(tmp_path, "first", "--steps", "6", "--stop-after", "3", "--strategy", strategy_file,
                      "--ckpt-dir", part_dir, "--ckpt-every", "3")
    assert first["losses"] == full["losses"][:3]
    assert sorted(os.listdir(part_dir)) == ["latest", "step-000003"]
    files = os.listdir(os.path.join(part_dir, "step-000003"))
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.json"} <= set(files), files
    one_dir = str(tmp_path / "one")
    shutil.copytree(part_dir, one_dir)

    rest, log = _train(tmp_path, "rest", "--steps", "6", "--ckpt-dir", part_dir, "--resume")
    assert "resumed from" in log
    assert rest["start"] == 3 and len(rest["losses"]) == 3
    # Same strategy, data, dropout seeds and optimizer state: the same floats, exactly.
    assert rest["losses"] == full["losses"][3:]

    a, b = _model(full_dir), _model(part_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

    # One process resumes the 2-process checkpoint for a step, under its own strategy
    # (the checkpoint reshards).  Dropout draws its masks per partition, so another
    # strategy draws others: the loss is close (2e-4 here), not equal; a model not
    # loaded would be 2% off.
    one, log = _train(tmp_path, "one", "--steps", "6", "--stop-after", "4", "--ckpt-dir", one_dir,
                      "--resume", "--nprocs", "1", "--budget", "0.5")
    assert "resumed from" in log and "(2 processes, now 1)" in log
    assert one["start"] == 3 and len(one["losses"]) == 1
    assert math.isclose(one["losses"][0], full["losses"][3], rel_tol=2e-3), (one["losses"], full["losses"])


@pytest.mark.slow
def test_bf16_mixed_and_params_train_and_an_unknown_precision_is_refused(tmp_path, strategy_file):
    mixed, _ = _train(tmp_path, "mixed", "--precision", "bf16-mixed", "--steps", "1", "--strategy", strategy_file)
    plain, _ = _train(tmp_path, "plain", "--steps", "1", "--strategy", strategy_file)
    # the same first loss within bfloat16 rounding, not the same bits
    assert math.isclose(mixed["losses"][0], plain["losses"][0], rel_tol=2e-2)
    assert mixed["losses"][0] != plain["losses"][0]
    params, _ = _train(tmp_path, "params", "--precision", "bf16-params", "--steps", "1", "--strategy", strategy_file)
    assert math.isclose(params["losses"][0], plain["losses"][0], rel_tol=2e-2)
    assert params["losses"][0] != plain["losses"][0]
    r = _run(tmp_path, "--precision", "16-mixed", "--steps", "1")
    assert r.returncode != 0 and "16-mixed" in r.stderr


def test_resume_of_another_model_is_refused(tmp_path):
    folder = tmp_path / "ckpt" / "step-000003"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"step": 3, "world_size": 2, "model": "rnnlm",
                                                  "size": "small", "batch": 4, "strategy": "{}"}))
    (tmp_path / "ckpt" / "latest").write_text("step-000003")
    r = _run(tmp_path, "--steps", "6", "--ckpt-dir", str(tmp_path / "ckpt"), "--resume", "--nprocs", "1")
    assert r.returncode != 0
    assert "rnnlm/small" in r.stderr and "transformer/small" in r.stderr
