"""Test-wide settings."""
import os
import tempfile

# Machine.detect() calibrates a new host once (several seconds, spawning processes);
# the tests use the cpu preset as it is, except the test of that calibration.
os.environ.setdefault("FLEXFLOW_NO_CALIBRATE", "1")
# The tests neither read nor fill the user's cache (calibrated machine, op profiles
# that parallelize() measures before a search): one fresh folder per test run.
os.environ.setdefault("FLEXFLOW_CACHE_DIR", tempfile.mkdtemp(prefix="flexflow-tests-"))
