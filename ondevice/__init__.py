"""ondevice: lossless speculative decoding on Apple Silicon.

    import ondevice
    gen = ondevice.load("smollm2-135m-instruct")
    print(gen.generate("Hello!").text)
"""

from __future__ import annotations

__version__ = "0.1.0"

from ondevice.api import Chunk, GenerationResult, Generator, load  # noqa: E402
from ondevice.errors import OndeviceError  # noqa: E402

__all__ = ["Chunk", "GenerationResult", "Generator", "OndeviceError", "__version__", "load"]
