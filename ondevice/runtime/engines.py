"""Engines: one small protocol for every way a language model runs here.

The speculative decoder only needs three things of a model: feed tokens and get logits back,
forget the last n tokens, and know how many tokens it holds. The verifier is always MLX; a draft
is MLX, Core ML (macOS 15+, Neural Engine) or the reference executor (the same `.mlpackage` run
in numpy, any OS).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from ondevice.models.transformer import Model
from ondevice.speculative.engine import Engine

__all__ = ["DRAFT_BACKENDS", "Engine", "MLXEngine", "TimedEngine", "make_draft_engine"]


class MLXEngine:
    """An MLX model with its own KV cache (the verifier, or the MLX copy of a draft)."""

    name = "mlx"

    def __init__(self, model: Model, context_length: int | None = None, prefill_chunk: int = 512):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.context_length = context_length or model.config.max_position_embeddings
        self.prefill_chunk = prefill_chunk
        self.cache = model.make_cache()

    @property
    def length(self) -> int:
        return self.cache.offset

    def reset(self) -> None:
        self.cache = self.model.make_cache()

    def forward(self, tokens: Sequence[int], last_only: bool = False) -> mx.array:
        """Lazy logits (L, vocab) for `tokens` appended to the cache (long inputs in chunks);
        with `last_only`, (1, vocab) for the last token."""
        toks = list(tokens)
        n = self.prefill_chunk
        while len(toks) > n:
            mx.eval(self.model(mx.array([toks[:n]]), self.cache, last_only=True), self.cache.state)
            toks = toks[n:]
        return self.model(mx.array([toks]), self.cache, last_only=last_only)[0]

    def feed(self, tokens: Sequence[int], last_only: bool = False) -> np.ndarray:
        logits = self.forward(tokens, last_only)
        if last_only:
            logits = logits[-1]
        return np.array(logits.astype(mx.float32))

    def trim(self, n: int) -> None:
        self.cache.trim(n)


class TimedEngine:
    """Wraps an engine and accumulates the wall time spent in its calls."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.name = engine.name
        self.vocab_size = engine.vocab_size
        self.context_length = engine.context_length
        self.seconds = 0.0
        self.calls = 0

    @property
    def length(self) -> int:
        return self.engine.length

    def reset(self) -> None:
        self.engine.reset()

    def feed(self, tokens: Sequence[int], last_only: bool = False) -> np.ndarray:
        t = time.perf_counter()
        out = self.engine.feed(tokens, last_only)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out

    def trim(self, n: int) -> None:
        self.engine.trim(n)


DRAFT_BACKENDS = ("auto", "coreml", "reference", "mlx")


def coreml_available() -> bool:
    """True where Core ML prediction runs: macOS 15 or newer with coremltools' native module."""
    import platform

    if platform.system() != "Darwin":
        return False
    try:
        major = int(platform.mac_ver()[0].split(".")[0])
    except ValueError:
        return False
    return major >= 15


def make_draft_engine(
    backend: str,
    *,
    mlx_model: Model | None,
    mlpackage: Path | None,
    context_length: int | None = None,
) -> Engine:
    """The draft engine for `backend` (`auto` picks Core ML where it runs, else MLX)."""
    from ondevice.errors import OndeviceError

    if backend not in DRAFT_BACKENDS:
        raise OndeviceError(f"unknown draft backend {backend!r}; choose one of {', '.join(DRAFT_BACKENDS)}.")
    if backend == "auto":
        if mlpackage is not None and coreml_available():
            backend = "coreml"
        elif mlx_model is not None:
            # Measured on Linux: the MLX draft is much faster than the numpy reference executor.
            backend = "mlx"
        else:
            backend = "reference"
    if backend == "mlx":
        if mlx_model is None:
            raise OndeviceError("draft backend 'mlx' needs the draft's MLX weights.")
        return MLXEngine(mlx_model, context_length)
    if mlpackage is None:
        raise OndeviceError(
            f"draft backend {backend!r} needs a Core ML draft: load a pair bundle made by "
            "`ondevice-convert` (it holds draft/draft.mlpackage)."
        )
    from ondevice.runtime.coreml_engines import CoreMLDraftEngine, ReferenceDraftEngine

    if backend == "coreml":
        if not coreml_available():
            raise OndeviceError(
                "draft backend 'coreml' needs macOS 15 or newer; use --draft-backend reference "
                "(the same .mlpackage run in numpy) or mlx."
            )
        return CoreMLDraftEngine(mlpackage)
    return ReferenceDraftEngine(mlpackage)
