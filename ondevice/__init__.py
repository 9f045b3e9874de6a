"""ondevice: lossless speculative decoding on Apple Silicon.

import ondevice
gen = ondevice.load("smollm2-135m-instruct")
print(gen.generate("Hello!").text)
"""

from __future__ import annotations

__version__ = "0.1.0"

# Before anything imports MLX: on Linux its wheel's reference BLAS is 5-30x slower than MKL or
# OpenBLAS, and only a library opened before libmlx serves its matrix products.
from ondevice.runtime import blas, quiet  # noqa: E402

blas.enable()
quiet.quiet_imports()

from ondevice.errors import OndeviceError  # noqa: E402

__all__ = ["Chunk", "GenerationResult", "Generator", "OndeviceError", "__version__", "load"]
_API = ("Chunk", "GenerationResult", "Generator", "load")


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    """The API on first use (it imports MLX): commands that need no model (`--help`, `doctor`)
    then work where MLX is missing, e.g. an x86_64 Python on an Apple Silicon Mac."""
    if name not in _API:
        raise AttributeError(f"module 'ondevice' has no attribute {name!r}")
    try:
        from ondevice import api
    except ImportError as e:
        if (e.name or "").split(".")[0] != "mlx":
            raise
        from ondevice.runtime.mlx_check import mlx_missing

        raise OndeviceError(mlx_missing(e)) from None
    return getattr(api, name)
