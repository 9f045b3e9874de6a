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

from ondevice.api import Chunk, GenerationResult, Generator, load  # noqa: E402
from ondevice.errors import OndeviceError  # noqa: E402

__all__ = ["Chunk", "GenerationResult", "Generator", "OndeviceError", "__version__", "load"]
