"""Test-wide settings."""
import os

# Machine.detect() calibrates a new host once (several seconds, spawning processes);
# the tests use the cpu preset as it is, except the test of that calibration.
os.environ.setdefault("FLEXFLOW_NO_CALIBRATE", "1")
