"""Test-wide settings: every test runs in its own environment.

Each test gets a fresh, empty flexflow cache (``FLEXFLOW_CACHE_DIR``: calibrated
machine, op profiles) and ``XDG_CACHE_HOME`` in a temporary folder, so no test reads
what another one (or the user) measured, and nothing is written under ``$HOME``.
``FLEXFLOW_NO_CALIBRATE=1``: ``parallelize`` never calibrates the host (several
seconds, spawning processes); the tests that calibrate unset it themselves.  The
other flexflow settings and torchrun's variables are unset, so the caller's shell
does not change what the tests see.

Worker processes (``launch``, ``subprocess``) inherit the environment at spawn time,
so they use the cache of the test (or of the module, for module-scoped fixtures)
that starts them.  A test that needs a calibrated or profiled cache makes it itself.
The global random generators (random, numpy, torch) are seeded before each test.
"""
from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile

import numpy
import pytest
import torch

# flexflow's settings (flexflow.settings.VARIABLES) and what torchrun sets: none leaks in
_UNSET = ("FLEXFLOW_TIMEOUT_S", "FLEXFLOW_LAUNCH_GRACE_S", "FLEXFLOW_FRONTEND", "FLEXFLOW_NO_JIT",
          "FLEXFLOW_GLOO_LOOP", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
          "MASTER_ADDR", "MASTER_PORT")


def _environment(root) -> dict:
    return {"FLEXFLOW_CACHE_DIR": os.path.join(root, "flexflow-cache"),
            "XDG_CACHE_HOME": os.path.join(root, "xdg-cache"),
            "FLEXFLOW_NO_CALIBRATE": "1"}


def _apply(mp: pytest.MonkeyPatch, root) -> None:
    """The environment above, and the global random generators seeded."""
    for k, v in _environment(root).items():
        mp.setenv(k, v)
    for k in _UNSET:
        mp.delenv(k, raising=False)
    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)


# At import (collection, session-scoped fixtures): one folder for the whole run.
_session = tempfile.mkdtemp(prefix="flexflow-tests-")
atexit.register(shutil.rmtree, _session, ignore_errors=True)
os.environ.update(_environment(_session))
for _k in _UNSET:
    os.environ.pop(_k, None)


@pytest.fixture(autouse=True, scope="module")
def _module_environment(tmp_path_factory):
    """A fresh cache (and seeded generators) for the module-scoped fixtures, which run
    before any test's own."""
    with pytest.MonkeyPatch.context() as mp:
        _apply(mp, tmp_path_factory.mktemp("env-module"))
        yield


@pytest.fixture(autouse=True)
def _test_environment(tmp_path_factory, monkeypatch):
    """A fresh, empty cache for every test (outside its ``tmp_path``, which stays the test's);
    the random generators seeded, so what a test draws does not hang on those before it."""
    _apply(monkeypatch, tmp_path_factory.mktemp("env"))
