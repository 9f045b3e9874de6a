"""Engines: one small protocol for every way a language model runs here.

The speculative decoder only needs three things of a model: feed tokens and get logits back,
forget the last n tokens, and know how many tokens it holds. The verifier is always MLX; a draft
is MLX, Core ML (macOS 15+, Neural Engine) or the reference executor (the same `.mlpackage` run
in numpy, any OS). `MLXTreeEngine` adds the tree passes (any attention mask, keep a subset of the
cache) that tree decoding needs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from ondevice.models.transformer import Model
from ondevice.runtime import kernel
from ondevice.speculative.engine import Engine

__all__ = [
    "DRAFT_BACKENDS",
    "Engine",
    "MLXEngine",
    "MLXTreeEngine",
    "TimedEngine",
    "make_draft_engine",
    "tree_engine",
]


class MLXEngine:
    """An MLX model with its own KV cache (the verifier, or the MLX copy of a draft)."""

    name = "mlx"

    def __init__(self, model: Model, context_length: int | None = None, prefill_chunk: int = 512):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.context_length = context_length or model.config.max_position_embeddings
        self.prefill_chunk = prefill_chunk
        self.cache = model.make_cache()
        # Served by the CPU kernel: a row's logits do not depend on the pass size, and a pass is
        # computed while it is built rather than lazily (runtime/kernel.py).
        self.batch_invariant = self.eager = kernel.serves(model)

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


class _Wrapper:
    """Another engine's model and cache, by delegation (subclasses add to what it can do)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.name = engine.name
        self.vocab_size = engine.vocab_size
        self.context_length = engine.context_length
        self.batch_invariant = getattr(engine, "batch_invariant", False)
        self.eager = getattr(engine, "eager", False)

    @property
    def length(self) -> int:
        return self.engine.length

    def reset(self) -> None:
        self.engine.reset()

    def feed(self, tokens: Sequence[int], last_only: bool = False) -> np.ndarray:
        return self.engine.feed(tokens, last_only)

    def trim(self, n: int) -> None:
        self.engine.trim(n)


class TimedEngine(_Wrapper):
    """Wraps an engine and accumulates the wall time spent in its calls."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        self.seconds = 0.0
        self.calls = 0

    def feed(self, tokens: Sequence[int], last_only: bool = False) -> np.ndarray:
        t = time.perf_counter()
        out = self.engine.feed(tokens, last_only)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out


class MLXTreeEngine(_Wrapper):
    """An `MLXEngine` (same model, same cache) that can also score tokens under any attention
    mask at explicit positions, and keep a subset of the last cache entries."""

    engine: MLXEngine

    def __init__(self, engine: MLXEngine):
        super().__init__(engine)
        self.model = engine.model

    def feed_masked(
        self, tokens: Sequence[int], positions: Sequence[int], visible: np.ndarray
    ) -> np.ndarray:
        """Append `tokens` at `positions`; token i attends where `visible[i]` is True, over the
        new tokens (L, L; the cached prefix is visible to all) or the whole cache (L, cache+L).
        Returns float32 logits (L, vocab)."""
        mask = mx.array(np.where(visible, 0.0, -np.inf).astype(np.float32))
        logits = self.engine.model(
            mx.array([list(tokens)]),
            self.engine.cache,
            positions=mx.array(np.asarray(positions, np.int32)),
            mask=mask,
        )[0]
        return np.array(logits.astype(mx.float32))

    def keep(self, n_recent: int, indices: Sequence[int]) -> None:
        self.engine.cache.keep(n_recent, indices)


def tree_engine(engine: Engine) -> Engine:
    """`engine` with tree passes when it can have them (MLX); other engines as they are."""
    if isinstance(engine, MLXEngine):
        return MLXTreeEngine(engine)
    return engine


DRAFT_BACKENDS = ("auto", "coreml", "reference", "mlx")


def coreml_status() -> str | None:
    """None where Core ML prediction runs (macOS 15+ with coremltools' native module), else
    why not, in a sentence."""
    import importlib
    import platform

    if platform.system() != "Darwin":
        return f"Core ML prediction needs macOS ({platform.system()} here)"
    version = platform.mac_ver()[0]
    try:
        major = int(version.split(".")[0])
    except ValueError:
        return f"unknown macOS version {version!r}"
    if major < 15:
        return f"macOS {version}: Core ML drafts (states, multifunction) need macOS 15 or newer"
    try:
        importlib.import_module("coremltools.libcoremlpython")
    except ImportError as e:
        from ondevice.runtime.coreml_engines import native_module_hint

        return f"coremltools' native module is missing ({e}): {native_module_hint()}"
    return None


def coreml_available() -> bool:
    """True where Core ML prediction runs: macOS 15 or newer with coremltools' native module."""
    return coreml_status() is None


FALLBACK_RECORD = "coreml-fallback.json"  # in the cache dir: the last fallback, for `doctor`


def _fall_back(reason: str, to: str, mlpackage: Path) -> None:
    """One line on stderr, and a note `ondevice doctor` reports."""
    import json
    import sys

    from ondevice.models.hub import cache_dir

    print(f"ondevice: Core ML draft unavailable ({reason}); using the {to} draft.", file=sys.stderr)
    try:
        root = cache_dir()
        root.mkdir(parents=True, exist_ok=True)
        record = {"reason": reason, "fallback": to, "package": str(mlpackage), "time": time.time()}
        (root / FALLBACK_RECORD).write_text(json.dumps(record))
    except OSError:
        pass  # a read-only cache must not stop generation


def make_draft_engine(
    backend: str,
    *,
    mlx_model: Model | None,
    mlpackage: Path | None,
    context_length: int | None = None,
) -> Engine:
    """The draft engine for `backend`.

    `auto` picks Core ML on a Mac where it runs, else MLX (else the reference executor). On a Mac
    any Core ML failure (native module, compilation, load, state, first prediction) falls back
    to the bundle's MLX draft with one line saying why; an explicit `coreml` raises instead.
    """
    import platform

    from ondevice.errors import CoreMLUnavailableError, OndeviceError

    if backend not in DRAFT_BACKENDS:
        raise OndeviceError(
            f"unknown draft backend {backend!r}; choose one of {', '.join(DRAFT_BACKENDS)}."
        )
    if backend in ("auto", "coreml") and mlpackage is not None:
        from ondevice.runtime.coreml_engines import CoreMLDraftEngine

        on_mac = platform.system() == "Darwin"
        reason = coreml_status()
        if reason is None:
            try:
                return CoreMLDraftEngine(mlpackage)
            except CoreMLUnavailableError as e:
                reason = str(e)
        if backend == "coreml":
            raise OndeviceError(
                f"draft backend 'coreml' is unavailable: {reason}. Use --draft-backend mlx or "
                "reference (the same .mlpackage run in numpy)."
            )
        fallback = "mlx" if mlx_model is not None else "reference"
        if on_mac:
            _fall_back(reason, "bundle's MLX" if fallback == "mlx" else "reference", mlpackage)
        backend = fallback
    elif backend == "auto":
        backend = "mlx" if mlx_model is not None else "reference"
    if backend == "mlx":
        if mlx_model is None:
            raise OndeviceError("draft backend 'mlx' needs the draft's MLX weights.")
        return MLXEngine(mlx_model, context_length)
    if mlpackage is None:
        raise OndeviceError(
            f"draft backend {backend!r} needs a Core ML draft: load a pair bundle made by "
            "`ondevice-convert` (it holds draft/draft.mlpackage)."
        )
    from ondevice.runtime.coreml_engines import ReferenceDraftEngine

    return ReferenceDraftEngine(mlpackage)
