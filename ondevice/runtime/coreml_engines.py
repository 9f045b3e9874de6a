"""Draft engines over a converted `.mlpackage`: Core ML (macOS 15+) and the numpy reference.

Both run the same package with the same logic; only the object that executes a function
differs: `coremltools.models.MLModel` on the Neural Engine, or `ReferenceModel` (numpy, any OS).

The cache is position-indexed, like gpt-fast's static cache: feeding writes the new tokens' keys
and values at [length, length + n) and attention masks every slot beyond each query's position.
So `trim(n)` only moves `length` back; the stale slots are invisible and get overwritten by the
next feed. Runs of tokens go through the `chunk` function (padded to its fixed length; padding
lands beyond the last real token, so it is overwritten before anything can attend to it), single
tokens through `decode`. With kv="io" the engine keeps the cache arrays itself and stores the new
rows each function returns.

Every `predict` gets the same input arrays, owned by the engine and filled in place: Core ML may
release an input on a background queue after the call returns (coremltools PRs #2827/#2829 report
SIGSEGV on macOS 26.6+ when that input was a temporary), so inputs must outlive every call.

The Core ML engine proves itself at start: the package is compiled once (cached under the ondevice
cache), each function loaded from the compiled model, the state made and a first prediction run
and checked for finite logits. Any failure raises CoreMLUnavailableError, on which
`make_draft_engine("auto")` falls back to the bundle's MLX draft.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ondevice.errors import (
    ContextLengthError,
    CoreMLRuntimeError,
    CoreMLUnavailableError,
    OndeviceError,
)

FUNCTIONS = ("decode", "chunk")
# The float type of arrays the engine hands Core ML: coremltools' native layer converts only
# int32, float32 and float64 arrays (coremlpython `dataTypeOf`), widening to the model's float16.
CORE_ML_FLOAT = np.float32


class _PackageDraftEngine:
    """The engine logic; subclasses only say how to load a function of the package."""

    name = "package"
    min_chunk_tokens = 2  # feeds of this many tokens or more use the chunk function

    def __init__(self, mlpackage: str | Path):
        from ondevice.runtime.mil.package import read_description

        self.path = Path(mlpackage)
        meta = read_description(self.path)
        self.meta = meta
        self.vocab_size = int(meta["vocab_size"])
        self.context_length = int(meta["context"])
        self.chunk = int(meta["chunk"])
        self.state_length = int(meta["state_length"])
        self.kv = meta["kv"]
        self.logit_names = list(meta["logits"])
        self.models = self._load_functions(self.path, FUNCTIONS)
        self._pos = 0
        if self.kv == "state":
            # One state shared by both functions: they declare the same KV-cache states.
            self._state = self._make_state()
        else:
            # float32, although the package declares float16: coremltools' predict replaces a
            # float16 input in the caller's dict by a float32 copy (its native layer takes only
            # int32/float32/float64), so float16 caches would be swapped out after one call and
            # the engine would keep writing into arrays Core ML never sees again.
            shape = tuple(meta["kv_cache"]["shape"])
            self._keys = np.zeros(shape, CORE_ML_FLOAT)
            self._values = np.zeros(shape, CORE_ML_FLOAT)
        # The engine's own input buffers, one set per function, refilled for every call.
        self._inputs: dict[str, dict[str, np.ndarray]] = {}
        for function, tokens in (("decode", 1), ("chunk", self.chunk)):
            buffers = {
                "input_ids": np.zeros((1, tokens), np.int32),
                "position": np.zeros((1,), np.int32),
            }
            if self.kv != "state":
                buffers["key_cache"], buffers["value_cache"] = self._keys, self._values
            self._inputs[function] = buffers

    def _load_functions(self, path: Path, names: Sequence[str]) -> dict[str, Any]:
        raise NotImplementedError

    def _make_state(self) -> Any:
        return self.models["decode"].make_state()

    @property
    def length(self) -> int:
        return self._pos

    def reset(self) -> None:
        self._pos = 0  # every slot is now beyond the position: masked, then overwritten

    def trim(self, n: int) -> None:
        if n < 0 or n > self._pos:
            raise ValueError(f"cannot trim {n} tokens from a cache of {self._pos}.")
        self._pos -= n

    def export_kv(self, n: int) -> dict[str, np.ndarray]:
        """Copies of the keys and values of the first n positions (float16, each
        (layers, kv_heads, n, head_dim)): a prefix the cache can start from again."""
        if not 0 <= n <= self._pos:
            raise ValueError(f"cannot export {n} positions of a cache holding {self._pos}.")
        if self.kv == "state":
            full = {k: self._state.read_state(k) for k in ("key_cache", "value_cache")}
        else:
            full = {"key_cache": self._keys, "value_cache": self._values}
        return {k: np.array(v[:, :, :n], np.float16) for k, v in full.items()}

    def import_kv(self, kv: dict[str, np.ndarray]) -> None:
        """Start from a prefix `export_kv` gave: the cache then holds its positions."""
        n = int(kv["key_cache"].shape[2])
        if n > self.context_length:
            raise ContextLengthError(f"a prefix of {n} tokens exceeds the draft's context.")
        if self.kv == "state":
            for name, part in kv.items():
                # float32: Core ML's write_state refuses float16 ("value type not convertible")
                # and converts to the state's float16 itself
                full = np.zeros(tuple(self.meta["kv_cache"]["shape"]), CORE_ML_FLOAT)
                full[:, :, :n] = part  # slots beyond n are masked until overwritten
                self._state.write_state(name, full)
        else:
            self._keys[:, :, :n] = kv["key_cache"]
            self._values[:, :, :n] = kv["value_cache"]
        self._pos = n

    def feed(self, tokens: Sequence[int], last_only: bool = False) -> np.ndarray:
        toks = [int(t) for t in tokens]
        if not toks:
            raise ValueError("feed needs at least one token.")
        if self._pos + len(toks) > self.context_length:
            raise ContextLengthError(
                f"the draft's context is {self.context_length} tokens; {self._pos} are in the "
                f"cache and {len(toks)} more were fed. Convert the draft with a larger --context."
            )
        if min(toks) < 0 or max(toks) >= self.vocab_size:
            raise OndeviceError(
                f"token id out of range for the draft's vocabulary ({self.vocab_size})."
            )
        rows: list[np.ndarray] = []
        i = 0
        while i < len(toks):
            left = len(toks) - i
            if left >= self.min_chunk_tokens and self._pos + self.chunk <= self.state_length:
                take = min(left, self.chunk)
                ids = toks[i : i + take] + [0] * (self.chunk - take)
                out = self._run("chunk", ids, take)
            else:
                take = 1
                out = self._run("decode", toks[i : i + 1], 1)
            last = i + take == len(toks)
            if not last_only or last:
                keep = slice(take - 1, take) if last_only else slice(0, take)
                rows.append(self._logits(out, keep))
            i += take
            self._pos += take
        logits = np.concatenate(rows, axis=0)
        return logits[-1] if last_only else logits

    def _run(self, function: str, ids: list[int], real: int) -> dict[str, np.ndarray]:
        inputs = self._inputs[function]
        inputs["input_ids"][0, :] = ids
        inputs["position"][0] = self._pos
        model = self.models[function]
        if self.kv == "state":
            return model.predict(inputs, state=self._state)
        out = model.predict(inputs)
        end = self._pos + real
        self._keys[:, :, self._pos : end] = out["new_keys"][:, :, :real]
        self._values[:, :, self._pos : end] = out["new_values"][:, :, :real]
        return out

    def _logits(self, out: dict[str, np.ndarray], rows: slice) -> np.ndarray:
        parts = [np.asarray(out[name])[0, rows] for name in self.logit_names]
        return np.concatenate(parts, axis=-1).astype(np.float32)


class ReferenceDraftEngine(_PackageDraftEngine):
    """The draft package run by the numpy reference executor (any OS)."""

    name = "reference"

    def __init__(self, mlpackage: str | Path, *, accumulate: str = "float32", probe: bool = False):
        """`accumulate` and `probe`: the executor's numerics mode and range probe."""
        self._options = {"accumulate": accumulate, "probe": probe}
        super().__init__(mlpackage)

    def _load_functions(self, path: Path, names: Sequence[str]) -> dict[str, Any]:
        from ondevice.runtime.mil.interpreter import ReferenceModel

        return ReferenceModel.load_functions(path, names, **self._options)


class CoreMLDraftEngine(_PackageDraftEngine):
    """The draft package run by Core ML on the Neural Engine (macOS 15 or newer).

    Raises CoreMLUnavailableError, naming the step, when coremltools' native module is missing or
    compiling, loading, making the state or the first prediction fails.
    """

    name = "coreml"

    def __init__(self, mlpackage: str | Path):
        try:
            import coremltools.libcoremlpython  # noqa: F401  (prediction lives there)
        except ImportError as e:
            raise CoreMLUnavailableError(
                f"coremltools' native module is missing ({e}): {native_module_hint()}"
            ) from None
        super().__init__(mlpackage)
        self._first_prediction()

    @staticmethod
    def _step(
        what: str, fn: Callable[[], Any], error: type[OndeviceError] = CoreMLUnavailableError
    ) -> Any:
        try:
            return fn()
        except OndeviceError:
            raise
        except Exception as e:  # coremltools raises bare Exception/RuntimeError/ValueError here
            raise error(f"Core ML {what} failed ({type(e).__name__}: {e})") from None

    def _load_functions(self, path: Path, names: Sequence[str]) -> dict[str, Any]:
        import coremltools as ct

        compiled = self._step("compilation", lambda: compiled_model(path))

        def load() -> dict[str, Any]:
            return {
                n: ct.models.CompiledMLModel(
                    str(compiled), compute_units=ct.ComputeUnit.CPU_AND_NE, function_name=n
                )
                for n in names
            }

        return self._step("load", load)

    def _make_state(self) -> Any:
        return self._step("make_state", super()._make_state)

    def _first_prediction(self) -> None:
        """Both functions predicted once (each may fail on its own: the Neural Engine compiles
        them separately), writing slot 0 only: masked, then overwritten."""
        for function, ids in (("decode", [0]), ("chunk", [0] * self.chunk)):
            out = self._step(
                f"first prediction of {function}",
                lambda f=function, i=ids: _PackageDraftEngine._run(self, f, i, 1),
            )
            if not np.isfinite(self._logits(out, slice(0, 1))).all():
                raise CoreMLUnavailableError(
                    f"Core ML first prediction of {function} returned non-finite logits "
                    "(float16 overflow on the Neural Engine?)"
                )

    # Core ML calls after the start: a failure is a CoreMLRuntimeError, on which the Generator
    # moves that model to the MLX draft.
    def _run(self, function: str, ids: list[int], real: int) -> dict[str, np.ndarray]:
        run = super()._run
        return self._step(
            f"{function} prediction", lambda: run(function, ids, real), CoreMLRuntimeError
        )

    def export_kv(self, n: int) -> dict[str, np.ndarray]:
        export = super().export_kv
        return self._step("state read", lambda: export(n), CoreMLRuntimeError)

    def import_kv(self, kv: dict[str, np.ndarray]) -> None:
        restore = super().import_kv
        self._step("state write", lambda: restore(kv), CoreMLRuntimeError)


def native_module_hint() -> str:
    if platform.system() == "Darwin" and platform.machine() != "arm64":
        from ondevice.runtime.mlx_check import install_hint

        return install_hint()
    return (
        f"coremltools has no native build for Python {platform.python_version()} here; use "
        "Python 3.10-3.13 (e.g. `brew install python@3.12` or `uv python install 3.12`) and "
        "reinstall ondevice in a virtualenv made with it."
    )


def package_digest(package: Path) -> str:
    """A digest of a package as Core ML sees it: its path and its files (small ones by content:
    coremltools rewrites Manifest.json unchanged whenever it opens a package; weights by size
    and mtime)."""
    package = Path(package).resolve()
    key = hashlib.sha256(str(package).encode())
    for f in sorted(package.rglob("*")):
        if f.is_file():
            st = f.stat()
            stamp = f.read_bytes() if st.st_size < 1 << 20 else f"{st.st_mtime_ns}".encode()
            key.update(f"{f.relative_to(package)}|{st.st_size}|".encode() + stamp)
    return key.hexdigest()


def compiled_model(package: Path) -> Path:
    """The package compiled to `.mlmodelc` once: cached under the ondevice cache, keyed by the
    package's path, its files (small ones by content: coremltools rewrites Manifest.json
    unchanged whenever it opens a package; weights by size and mtime) and the OS version, and
    written atomically."""
    from coremltools.models.utils import compile_model

    from ondevice.sources.hub import cache_dir

    package = Path(package).resolve()
    key = hashlib.sha256(f"{package_digest(package)}|{platform.mac_ver()[0]}".encode())
    root = cache_dir() / "compiled"
    final = root / f"{key.hexdigest()[:24]}.mlmodelc"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{os.getpid()}-{final.name}"  # compile_model wants the .mlmodelc suffix
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        built = Path(compile_model(str(package), str(tmp)))
        os.replace(built, final)
    except OSError:
        if not final.is_dir():  # another process may have won the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# -- where Core ML runs, and what happens when it does not ------------------------------------


def coreml_status() -> str | None:
    """None where Core ML prediction runs (macOS 15+ with coremltools' native module), else
    why not, in a sentence."""
    import importlib

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
        return f"coremltools' native module is missing ({e}): {native_module_hint()}"
    return None


def coreml_available() -> bool:
    """True where Core ML prediction runs: macOS 15 or newer with coremltools' native module."""
    return coreml_status() is None


FALLBACK_RECORD = "coreml-fallback.json"  # in the cache dir: the last fallback, for `doctor`


def fall_back(reason: str, to: str, mlpackage: Path) -> None:
    """One line on stderr, and a note `ondevice doctor` reports."""
    import json
    import sys

    from ondevice.sources.hub import cache_dir

    print(f"ondevice: Core ML draft unavailable ({reason}); using the {to} draft.", file=sys.stderr)
    try:
        root = cache_dir()
        root.mkdir(parents=True, exist_ok=True)
        record = {"reason": reason, "fallback": to, "package": str(mlpackage), "time": time.time()}
        (root / FALLBACK_RECORD).write_text(json.dumps(record))
    except OSError:
        pass  # a read-only cache must not stop generation
