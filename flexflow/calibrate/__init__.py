"""Host calibration (it runs the runtime on local processes, so it sits above it).

- :mod:`.host`: :func:`calibrate` (``flexflow calibrate``) and :func:`ensure_calibrated`;
- :mod:`.comm`: gloo message, all-reduce and compute figures between local processes;
- :mod:`.hostfit`: the figures fitted to the executor's own steps on this host.
"""
from .host import calibrate, ensure_calibrated, is_calibrated

__all__ = ["calibrate", "ensure_calibrated", "is_calibrated"]
