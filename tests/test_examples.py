"""The training example: checkpoint and resume continue with the same losses."""
import json
import os
import subprocess
import sys

import pytest

import flexflow as ff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp_path, *extra):
    out = tmp_path / f"losses{len(list(tmp_path.iterdir()))}.json"
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train.py"), "--model", "rnnlm", "--batch", "6",
           "--nprocs", "2", "--lr", "0.5", "--losses-out", str(out), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_checkpoint_resume_gives_the_same_losses(tmp_path):
    module, inputs = ff.models.get("rnnlm", size="small", batch_size=6)
    graph = ff.trace(module, inputs)
    strategy = ff.Strategy.random(graph, ff.Machine.preset("p100-cluster", devices=2), seed=3)
    sfile = tmp_path / "strategy.json"
    sfile.write_text(strategy.to_json())
    full = _train(tmp_path, "--steps", "4", "--strategy", str(sfile))
    ckpt = str(tmp_path / "ckpt.pt")
    first = _train(tmp_path, "--steps", "2", "--strategy", str(sfile), "--checkpoint", ckpt, "--save-every", "2")
    rest = _train(tmp_path, "--steps", "4", "--checkpoint", ckpt, "--resume")
    assert first["losses"] == full["losses"][:2]
    assert rest["start"] == 2
    for a, b in zip(rest["losses"], full["losses"][2:]):
        assert abs(a - b) <= 1e-6 * abs(b)
    # the checkpoint's parameters load into the plain model
    import torch
    state = torch.load(ckpt, weights_only=False)["model"]
    fresh, _ = ff.models.get("rnnlm", size="small", batch_size=6)
    fresh.load_state_dict(state)
