"""Engines: one small protocol for every way a language model runs here.

The speculative decoder only needs three things of a model: feed tokens and get logits back,
forget the last n tokens, and know how many tokens it holds. The verifier is always MLX; a draft
is MLX, Core ML (macOS 15+, Neural Engine) or the reference executor (the same `.mlpackage` run
in numpy, any OS). `MLXTreeEngine` adds the tree passes (any attention mask, keep a subset of the
cache) that tree decoding needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ondevice.models.transformer import Model
from ondevice.rules.engine import Engine, in_prompt
from ondevice.runtime import kernel
from ondevice.runtime.coreml_engines import (  # noqa: F401  (their old home)
    FALLBACK_RECORD,
    coreml_available,
    coreml_status,
    fall_back,
)

__all__ = [
    "DRAFT_BACKENDS",
    "DraftWindow",
    "Engine",
    "MLXEngine",
    "MLXTreeEngine",
    "draft_window",
    "innermost",
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
        # Served by the CPU kernel, a pass is computed while it is built rather than lazily, and
        # a row's logits do not depend on how many tokens share the pass: its linear products
        # and its attention run at shapes fixed per row (runtime/kernel.py). MLX's own products
        # (MKL's, Metal's) pick their blocking by shape, so elsewhere no engine claims it.
        self.eager = kernel.serves(model)
        self.batch_invariant = kernel.batch_invariant(model)
        # Where prompts are computed with other instructions than decoding (runtime/kernel.py,
        # "Prompts apart"), only the rows a prompt pass wrote equal a later prompt's own.
        self.prompts_apart = kernel.prompts_apart(model)
        self.prompt_rows = 0  # the cache's first rows a prompt pass (`prefill`) wrote

    @property
    def length(self) -> int:
        return self.cache.offset

    @property
    def reusable(self) -> int:
        """How many of the cache's first positions a later prompt sharing them may take as its
        own (the prompt cache): all, unless prompts are computed apart."""
        return min(self.prompt_rows, self.length) if self.prompts_apart else self.length

    def adopt(self, cache: Any) -> None:
        """Take `cache` (a prompt cache entry's rows, which were all reusable) as this one's."""
        self.cache, self.prompt_rows = cache, cache.offset

    def reset(self) -> None:
        self.cache = self.model.make_cache()
        self.prompt_rows = 0

    def forward(self, tokens: Sequence[int], last_only: bool = False) -> mx.array:
        """Lazy logits (L, vocab) for `tokens` appended to the cache (long inputs in chunks);
        with `last_only`, (1, vocab) for the last token."""
        return self._append(tokens, last_only)[0]

    def last_hidden(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens` (as `forward`) and return the last one's hidden state after the
        final norm, (hidden_size,) float32: what a Medusa head drafts from."""
        _, states = self._append(tokens, True, hidden=True)
        return np.array(states[0, -1].astype(mx.float32))

    def _append(self, tokens: Sequence[int], last_only: bool, hidden: bool = False) -> Any:
        """The model's output (batch of one) for the last chunk of `tokens` (see `forward`)."""
        toks = list(tokens)
        if in_prompt() and self.length <= self.prompt_rows:
            self.prompt_rows = self.length + len(toks)
        n = self.prefill_chunk
        while len(toks) > n:
            mx.eval(self.model(mx.array([toks[:n]]), self.cache, last_only=True), self.cache.state)
            toks = toks[n:]
        return self.model(mx.array([toks]), self.cache, last_only=last_only, hidden=hidden)

    def feed(self, tokens: Sequence[int], last_only: bool = False) -> np.ndarray:
        logits = self.forward(tokens, last_only)
        if last_only:
            logits = logits[-1]
        return np.array(logits.astype(mx.float32))

    def trim(self, n: int) -> None:
        self.cache.trim(n)
        self.prompt_rows = min(self.prompt_rows, self.length)


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


class MLXTreeEngine(_Wrapper):
    """An `MLXEngine` (same model, same cache) that can also score tokens under any attention
    mask at explicit positions, and keep a subset of the last cache entries."""

    engine: MLXEngine
    # feed_masked(..., hidden=True) also gives the last hidden states, last_hidden a prompt's
    returns_hidden = True

    def __init__(self, engine: MLXEngine):
        super().__init__(engine)
        self.model = engine.model

    def feed_masked(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        visible: np.ndarray,
        *,
        hidden: bool = False,
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Append `tokens` at `positions`; token i attends where `visible[i]` is True, over the
        new tokens (L, L; the cached prefix is visible to all) or the whole cache (L, cache+L).
        Returns float32 logits (L, vocab); with `hidden`, also the last hidden states
        (L, hidden_size) float32."""
        mask = mx.array(np.where(visible, 0.0, -np.inf).astype(np.float32))
        out = self.engine.model(
            mx.array([list(tokens)]),
            self.engine.cache,
            positions=mx.array(np.asarray(positions, np.int32)),
            mask=mask,
            hidden=hidden,
        )
        logits, states = out if hidden else (out, None)
        logits = np.array(logits[0].astype(mx.float32))
        if states is None:
            return logits
        return logits, np.array(states[0].astype(mx.float32))

    def last_hidden(self, tokens: Sequence[int]) -> np.ndarray:
        return self.engine.last_hidden(tokens)

    def keep(self, n_recent: int, indices: Sequence[int]) -> None:
        engine = self.engine
        engine.prompt_rows = min(engine.prompt_rows, engine.length - n_recent)
        engine.cache.keep(n_recent, indices)


def tree_engine(engine: Engine) -> Engine:
    """`engine` with tree passes when it can have them (MLX); other engines as they are."""
    if isinstance(engine, MLXEngine):
        return MLXTreeEngine(engine)
    return engine


class DraftWindow:
    """A draft that never runs out of context: its cache holds only the most recent tokens.

    A draft's context is fixed (a converted package's is; the verifier's is far longer), and
    drafting needs recent context, not the whole prompt. Length, `feed` and `trim` speak of the
    whole sequence, as for any engine; the cache holds the window `tokens[start:]` at positions
    0.., exactly what a fresh draft given only those tokens would hold. Where the next token
    would not fit, the cache is emptied and refilled with the newest `window - stride` tokens
    in one prefill, so the window moves `stride` tokens at a time and a prompt longer than the
    window costs the draft one window's prefill, not the prompt's.

    `start` depends only on the position of the token fed (`window_start`), never on how the
    cache got there (a long feed, one token at a time, a trim back across a move), so every
    decoder sees the same draft distribution at a position and a seed keeps its meaning.

    Drafts cross a move and are then rejected, again and again, until the committed sequence
    is past it: so the window it left is kept aside (`_other`: an MLX cache as it is, a package
    draft's KV copied) and taken up again, for the part of its tokens still in the sequence,
    instead of being refilled; likewise the new one when drafting crosses the move again.

    With an engine that has tree passes (`feed_masked`, `keep`: MLX), so has the window; tree
    nodes are fed beyond the window's end without moving it (an MLX cache has no hard end).
    """

    def __init__(self, engine: Engine, window: int, context_length: int):
        if window < 2:
            raise ValueError(f"a draft window needs at least 2 tokens, got {window}.")
        self.engine = engine
        self.name = engine.name
        self.vocab_size = engine.vocab_size
        self.window = window
        self.stride = window // 2
        self.context_length = context_length  # the sequence's limit: the verifier's context
        self.tokens: list[int] = []
        self.start = 0  # the sequence position of the cache's first entry
        self._held: list[int] = []  # what the cache holds (positions 0..), even when stale
        self._stale = False  # the cache is not tokens[start:]: refilled at the next feed
        self._other: tuple[int, list[int], Any] | None = None  # (start, held, snapshot)
        self.moves = 0  # refills from a window that starts past the sequence's beginning

    def window_start(self, i: int) -> int:
        """Where the window that holds the token at position i starts."""
        if i < self.window:
            return 0
        return ((i - self.window) // self.stride + 1) * self.stride

    def _next_move(self, i: int) -> int:
        """The first position after i whose token needs a window starting elsewhere."""
        if i < self.window:
            return self.window
        return self.window + ((i - self.window) // self.stride + 1) * self.stride

    def _last_move(self, i: int) -> int:
        """The first position of the run of positions up to i whose window starts alike."""
        if i < self.window:
            return 0
        return self.window + ((i - self.window) // self.stride) * self.stride

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def model(self) -> Model:
        """The draft's MLX model, as its engine has it (AttributeError for a package draft)."""
        return innermost(self.engine).model  # type: ignore[attr-defined]

    def holds_prefix(self, n: int) -> bool:
        """Whether the engine's cache holds the sequence's first n tokens at their positions
        (the window has not moved): what the prompt cache can keep of it."""
        return self.start == 0 and not self._stale and n <= self.engine.length

    def adopt(self, tokens: Sequence[int]) -> None:
        """The engine's cache was given `tokens` from outside (the prompt cache)."""
        if self.engine.length != len(tokens) or self.window_start(max(len(tokens) - 1, 0)):
            raise ValueError("a restored draft cache must hold a prefix within the window")
        self.tokens, self._held = [int(t) for t in tokens], [int(t) for t in tokens]
        self.start, self._stale, self._other = 0, False, None

    def reset(self) -> None:
        self.engine.reset()
        self.tokens, self._held, self.start, self._stale, self._other = [], [], 0, False, None

    def trim(self, n: int) -> None:
        if n < 0 or n > len(self.tokens):
            raise ValueError(f"cannot trim {n} tokens from a cache of {len(self.tokens)}.")
        if n == 0:
            return
        end = len(self.tokens) - n
        del self.tokens[end:]
        if not self._stale and end > self.start and self.window_start(end - 1) == self.start:
            self.engine.trim(n)
            del self._held[end - self.start :]
        else:
            self._stale = True  # back across a move: the other window, or a refill, next feed

    # -- moving the window ------------------------------------------------------------------

    def _snapshot(self) -> Any:
        """The cache as it is, to be taken up again (None: this engine cannot)."""
        inner = innermost(self.engine)
        if isinstance(inner, MLXEngine):
            return inner.cache  # `reset` gives the engine a new one: no copy
        export = getattr(inner, "export_kv", None)
        return export(inner.length) if export is not None else None

    def _take_up(self, snapshot: Any) -> None:
        inner = innermost(self.engine)
        if isinstance(inner, MLXEngine):
            inner.cache = snapshot
        else:
            inner.import_kv(snapshot)  # type: ignore[attr-defined]

    def _refill(self, seq: Sequence[int], start: int, end: int) -> None:
        """Make the cache hold seq[start:end] at positions 0.., from what this window or the
        other one still holds of them, the rest fed in one prefill."""
        if start != self.start:  # swap windows: this one is kept aside, the other taken up
            other = self._other
            snapshot = self._snapshot() if self._held else None
            self._other = (self.start, self._held, snapshot) if snapshot is not None else None
            self.engine.reset()
            self._held, self.start = [], start
            if other is not None and other[0] == start:
                self._take_up(other[2])
                self._held = other[1]
        same = 0
        for a, b in zip(self._held, seq[start:end]):
            if a != b:
                break
            same += 1
        if same < len(self._held):
            self.engine.trim(len(self._held) - same)
        if end > start + same:
            self.engine.feed(seq[start + same : end], last_only=True)
            self.moves += start > 0
        self._held = list(seq[start:end])
        self._stale = False

    def feed(self, tokens: Sequence[int], last_only: bool = False) -> np.ndarray:
        toks = [int(t) for t in tokens]
        if not toks:
            raise ValueError("feed needs at least one token.")
        seq = self.tokens + toks
        end = len(seq)
        i = len(self.tokens)
        if last_only:  # only the last run's logits are asked for: the others need no pass
            i = max(i, self._last_move(end - 1))
        rows = []
        while i < end:
            j = min(end, self._next_move(i))
            start = self.window_start(i)
            if self._stale or start != self.start or self.engine.length != i - start:
                self._refill(seq, start, i)
            rows.append(self.engine.feed(seq[i:j], last_only=last_only and j == end))
            self._held.extend(seq[i:j])
            i = j
        self.tokens = seq
        return rows[-1] if last_only else np.concatenate(rows, axis=0)


class TreeDraftWindow(DraftWindow):
    """A `DraftWindow` over an engine with tree passes (see `MLXTreeEngine`): positions and
    visibility are given in sequence terms and translated to the window's."""

    def feed_masked(
        self, tokens: Sequence[int], positions: Sequence[int], visible: np.ndarray
    ) -> np.ndarray:
        n = len(self.tokens)
        if self._stale or self.engine.length != n - self.start:
            self._refill(self.tokens, self.window_start(n - 1), n)
        s = self.start
        logits = self.engine.feed_masked(  # type: ignore[attr-defined]
            tokens, np.asarray(positions) - s, np.asarray(visible)[:, s:]
        )
        self.tokens.extend(int(t) for t in tokens)
        self._held.extend(int(t) for t in tokens)
        return logits

    def keep(self, n_recent: int, indices: Sequence[int]) -> None:
        self.engine.keep(n_recent, indices)  # type: ignore[attr-defined]
        for held in (self.tokens, self._held):
            recent = held[len(held) - n_recent :]
            del held[len(held) - n_recent :]
            held.extend(recent[i] for i in indices)


def draft_window(engine: Engine, context_length: int, window: int | None = None) -> DraftWindow:
    """`engine` (a draft) behind a `DraftWindow` of `window` tokens (default: its own context)
    for sequences up to `context_length` (the verifier's); a window is returned as it is."""
    if isinstance(engine, DraftWindow):
        return engine
    engine = tree_engine(engine)
    size = min(window or engine.context_length, engine.context_length)
    kind = TreeDraftWindow if hasattr(engine, "feed_masked") else DraftWindow
    return kind(engine, size, context_length)


def innermost(engine: Engine) -> Engine:
    """The engine under any wrappers (windows, timers, tree passes)."""
    while isinstance(engine, (DraftWindow, _Wrapper)):
        engine = engine.engine
    return engine


DRAFT_BACKENDS = ("auto", "coreml", "reference", "mlx")


def make_draft_engine(
    backend: str,
    *,
    mlx_model: Model | None,
    mlpackage: Path | None,
    context_length: int | None = None,
) -> Engine:
    """The draft engine for `backend`.

    `auto` picks Core ML on a Mac where it runs, else MLX (else the reference executor). On a Mac
    any Core ML failure (native module, compilation, load, state, first prediction of either
    function, or a start that kills or hangs the probe process of `coreml_probe.verdict`) falls
    back to the bundle's MLX draft with one line saying why; an explicit `coreml` raises instead.
    """
    import platform

    from ondevice.errors import CoreMLUnavailableError, OndeviceError

    if backend not in DRAFT_BACKENDS:
        raise OndeviceError(
            f"unknown draft backend {backend!r}; choose one of {', '.join(DRAFT_BACKENDS)}."
        )
    if backend in ("auto", "coreml") and mlpackage is not None:
        from ondevice.runtime.coreml_engines import CoreMLDraftEngine
        from ondevice.runtime.coreml_probe import verdict

        on_mac = platform.system() == "Darwin"
        reason = coreml_status()
        if reason is None:  # a start that kills its process is caught in a child, once
            reason = verdict(mlpackage)
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
            fall_back(reason, "bundle's MLX" if fallback == "mlx" else "reference", mlpackage)
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
