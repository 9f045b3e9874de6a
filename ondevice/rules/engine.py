"""The engine protocol: what the speculative logic needs of a language model, nothing more.

It lives here, free of MLX, so the rules and decoders in this package work over any engine
(MLX, Core ML, the numpy reference executor, or a test double in exhaustive tests).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Engine(Protocol):
    """A causal LM with a cache.

    `feed(tokens)` appends `tokens` to the cache and returns float32 logits of shape
    (len(tokens), vocab) (or only the last row, shape (vocab,), when `last_only`). `trim(n)`
    forgets the last n tokens. `length` is the number of tokens in the cache.

    An engine may also set `batch_invariant = True` when a row's logits do not depend on how
    many tokens share its pass (see `batch_invariant`).
    """

    name: str
    vocab_size: int
    context_length: int

    @property
    def length(self) -> int: ...

    def reset(self) -> None: ...

    def feed(self, tokens: Sequence[int], last_only: bool = False) -> np.ndarray: ...

    def trim(self, n: int) -> None: ...


def batch_invariant(engine: Engine) -> bool:
    """Whether feeding tokens in one call gives bitwise the logits and cache of feeding them one
    at a time (e.g. an MLX model served by the CPU kernel, `runtime/kernel.py`)."""
    return bool(getattr(engine, "batch_invariant", False))


def prefill(
    engine: Engine, tokens: Sequence[int], resume: bool = False, hidden: bool = False
) -> np.ndarray | None:
    """Make the engine's cache hold `tokens` (their logits are not needed).

    resume: the cache already holds a prefix of `tokens` (its first `length` entries, restored
    by the prompt cache, `runtime/prefix_cache.py`); only the rest is fed. Otherwise the cache
    starts empty. hidden: return the last token's hidden state (an engine with `last_hidden`,
    `runtime/engines.MLXTreeEngine`), None where the cache already held every token."""
    if not resume:
        engine.reset()
    start = engine.length
    if start > len(tokens):
        raise ValueError(f"the cache holds {start} tokens, more than the {len(tokens)} to prefill")
    if len(tokens) == start:
        return None
    _pass.prompt = True
    try:
        if hidden:
            return engine.last_hidden(tokens[start:])  # type: ignore[attr-defined]
        engine.feed(tokens[start:], last_only=True)
        return None
    finally:
        _pass.prompt = False


_pass = threading.local()  # what this thread's engine is feeding


def in_prompt() -> bool:
    """Whether this thread is inside `prefill`, feeding a prompt rather than decoding: a kernel
    may compute a prompt's rows with other instructions than decoded ones, where both give a
    row the same value whatever the pass's size but not each other's (runtime/kernel.py,
    "Prompts apart")."""
    return getattr(_pass, "prompt", False)
