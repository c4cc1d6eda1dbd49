"""Where an op came from: the user's source line of an fx node or a traceback
(frames inside torch and flexflow skipped).  Shared by both capture front ends."""
from __future__ import annotations

import os
import re
import traceback

import torch
import torch.fx as fx

_OWN_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))


def _user_frame(tb) -> str:
    """file:line of the innermost frame outside torch and flexflow."""
    where = ""
    for frame in traceback.extract_tb(tb):
        if not frame.filename.startswith(_OWN_DIRS):
            where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return where


def _source_of(node: fx.Node) -> str:
    st = node.meta.get("stack_trace") or ""
    hits = re.findall(r'File "([^"]+)", line (\d+)', st)
    for fname, line in reversed(hits):
        if not fname.startswith(_OWN_DIRS):
            return f"{os.path.basename(fname)}:{line}"
    return ""
