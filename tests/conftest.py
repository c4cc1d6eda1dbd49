"""Test-wide settings."""
import atexit
import os
import shutil
import tempfile

# Machine.detect() calibrates a new host once (several seconds, spawning processes);
# the tests use the cpu preset as it is, except the test of that calibration.
os.environ.setdefault("FLEXFLOW_NO_CALIBRATE", "1")
# The tests neither read nor fill the user's cache (calibrated machine, op profiles
# that parallelize() measures before a search): one fresh folder per test run.
if "FLEXFLOW_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="flexflow-tests-")
    os.environ["FLEXFLOW_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
