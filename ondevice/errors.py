"""Errors a user can act on. The CLI prints their message without a traceback."""

from __future__ import annotations

from collections.abc import Iterable


class OndeviceError(Exception):
    """Base class: the message says what is wrong and what to do."""


class ModelFormatError(OndeviceError):
    """A checkpoint, config or weight file is missing, truncated or inconsistent."""


class ModelNotFoundError(OndeviceError):
    """A model name resolves to nothing that can be loaded (locally or, when online, on the hub)."""


class TokenizerMismatchError(OndeviceError):
    """Draft and verifier tokenizers disagree."""


class ContextLengthError(OndeviceError):
    """The prompt (plus the requested tokens) does not fit the model's context."""


class BundleError(OndeviceError):
    """A pair bundle is missing, corrupted or of an unknown format version."""


class ConversionError(OndeviceError):
    """A converted draft would not run as intended on the Neural Engine (lint, float16 range)."""


class CoreMLUnavailableError(OndeviceError):
    """Core ML cannot run the draft here (native module, compilation, load, state, prediction)."""


class CoreMLRuntimeError(CoreMLUnavailableError):
    """Core ML failed after the draft had started (a prediction, a state read or write)."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """A hint naming the known names closest to a mistyped `name` (difflib's ratio, as git and
    pip suggest): " Did you mean 'x'?", or "" when none is close."""
    import difflib

    # the name itself is no hint: it is known and still did not serve (a pair's name where
    # one model is wanted)
    close = difflib.get_close_matches(name, [k for k in known if k != name], n=3, cutoff=0.6)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(c) for c in close) + "?"
