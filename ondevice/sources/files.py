"""Files on disk while getting a model: whole-file hashes and the liveness of a staging folder's
owner. Below the model (`models/bundle.py` hashes a bundle's files with the same helper)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

_HASH_BLOCK = 1 << 20


def sha256_file(path: Path, progress: Callable[[int], object] | None = None) -> str:
    """Hex sha256 of a file, read in blocks; `progress(n)` is told each block's size."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
            if progress is not None:
                progress(len(block))
    return h.hexdigest()


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists: staging folders named after a dead one are leftovers."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True
