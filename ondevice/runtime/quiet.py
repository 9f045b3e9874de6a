"""Silence the notices libraries print on import that say nothing to an ondevice user.

- coremltools logs "Failed to load _MLModelProxy: No module named 'coremltools.libcoremlpython'"
  (and the same for seven other proxies) on every OS without Core ML prediction (Linux):
  conversion and the reference executor do not need that module; `ondevice doctor` reports it.
- transformers logs "PyTorch was not found. Models won't be available ..." as an advisory
  notice: ondevice uses its tokenizers and templates only, and never torch.

Everything else these libraries log still reaches the user.
"""

from __future__ import annotations

import logging
import os
import sys


class _DropMissingProxy(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("Failed to load _ML") and "libcoremlpython" in msg)


def quiet_imports() -> None:
    """Install the filters; call before coremltools or transformers is imported."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if sys.platform != "darwin":  # on a Mac a missing proxy is a real fault: let it show
        logger = logging.getLogger("coremltools")  # its modules all log through this one
        if not any(isinstance(f, _DropMissingProxy) for f in logger.filters):
            logger.addFilter(_DropMissingProxy())
