"""Importing ondevice and what it uses prints nothing a user cannot act on (issue 19: the first
run printed eight coremltools proxy lines and transformers' PyTorch notice on Linux)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import ondevice
import coremltools
from coremltools.models import compute_plan, compute_device
from coremltools.models.ml_program.experimental import compute_plan_utils
import transformers
from ondevice.convert import coreml
from ondevice.runtime.mil import interpreter
import logging
logging.getLogger("coremltools").warning("a real coremltools warning")
"""


def test_imports_print_only_real_warnings() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" not in proc.stderr
    assert "PyTorch was not found" not in proc.stderr
    assert "a real coremltools warning" in proc.stderr  # only the known notices are dropped
