"""Memory on a Mac: MLX's wired and cache limits sized from the GPU's working set and the models,
and the process's peak footprint (MLX and Core ML together) beside MLX's own peak; and on any
machine, handing freed memory back to the system (`release`) between phases that each need much.

As mlx-lm does while it generates, the wired limit is raised to the Metal device's recommended
working set, so the weights stay resident instead of being paged between passes, with a warning
when the models come close to it. The buffer cache (freed MLX buffers kept for reuse) is capped
at a share of what the models leave free, so that on an 8 GB Mac it does not crowd out the Core
ML draft, which allocates outside MLX.
"""

from __future__ import annotations

import ctypes
import gc
import resource
import sys
from dataclasses import dataclass
from typing import Any


def _glibc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        return libc
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_libc = _glibc() if sys.platform.startswith("linux") else None


def release(collect: bool = False) -> None:
    """Hand freed memory back to the system: out of MLX's buffer cache, and out of the C heap,
    where glibc keeps freed blocks below its (adaptive, up to 32 MB) mmap threshold resident
    until trimmed, per thread's arena, so a later phase does not necessarily reuse them.
    `collect`: collect reference cycles first (a phase's objects, after it returns).

    The CPU kernel calls it as it replaces weights (the parts of a joined product would stay
    beside the joint copy), the converter between its phases: after converting the 0.5B draft
    8.9 GiB stayed resident, of which 0.9 GiB was live (docs/benchmarks.md, "The conversion's
    memory")."""
    import mlx.core as mx

    if collect:
        gc.collect()
    mx.clear_cache()
    if _libc is not None:
        _libc.malloc_trim(0)


CACHE_SHARE = 0.25  # of the working set the models leave free
CLOSE_TO_LIMIT = 0.9  # mlx-lm warns above this share of the recommended working set


@dataclass(frozen=True)
class MetalLimits:
    wired: int
    cache: int
    warning: str | None


def metal_limits(working_set: int, model_bytes: int) -> MetalLimits:
    """Limits for models of `model_bytes` on a device whose recommended working set is
    `working_set` bytes."""
    warning = None
    if model_bytes > CLOSE_TO_LIMIT * working_set:
        warning = (
            f"the models need {model_bytes >> 20} MB, close to this Mac's recommended GPU working "
            f"set of {working_set >> 20} MB: generation may be slow (try a smaller or more "
            "quantized model)"
        )
    cache = int(CACHE_SHARE * max(0, working_set - model_bytes))
    return MetalLimits(working_set, cache, warning)


def apply_metal_limits(model_bytes: int) -> MetalLimits | None:
    """Set MLX's wired and cache limits on Metal (None elsewhere); one line when close."""
    import mlx.core as mx

    if not mx.metal.is_available():
        return None
    limits = metal_limits(int(mx.device_info()["max_recommended_working_set_size"]), model_bytes)
    if limits.warning:
        print(f"ondevice: warning: {limits.warning}.", file=sys.stderr)
    mx.set_wired_limit(limits.wired)
    mx.set_cache_limit(limits.cache)
    return limits


def param_bytes(model: Any) -> int:
    """Bytes held by a model's parameters (packed weights, scales and biases when quantized)."""
    from mlx.utils import tree_flatten

    return int(sum(v.nbytes for _, v in tree_flatten(model.parameters())))


def peak_footprint_bytes() -> int:
    """The process's peak resident memory: MLX's arrays, the Core ML draft and Python alike."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KB on Linux
