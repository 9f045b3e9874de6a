"""A strict stand-in for Core ML on Linux: coremltools' own Python layer over a fake native module.

Only coremltools' native extension (`coremltools.libcoremlpython`, Objective-C++ over
CoreML.framework) is replaced; everything above it is coremltools' real code:
`coremltools.models.utils.compile_model`, `CompiledMLModel` (its argument checks and its
`predict`, which runs `MLModel._update_float16_multiarray_input_to_float32` and so replaces
float16 arrays in the caller's input dict in place), `MLModel` and `MLState`. The fake native
layer computes with the project's reference executor and enforces the rules coremltools 9.0's
`coremlpython` sources state:

- `CoreMLPythonArray.mm`, `dataTypeOf`: an array becomes an `MLMultiArray` only if it is int32,
  float32 or float64 (int8 only in macOS 26 SDK builds, not modelled); any other dtype (float16,
  int64, bool, ...) makes `Utils::convertValueToObjC` (`CoreMLPythonUtils.mm`) throw
  "value type not convertible". This applies to predict inputs and to `write_state` values.
- The array is wrapped, not copied (`initWithDataPointer`): Core ML reads the caller's memory and
  holds a reference to it until Core ML releases the feature value (`inputs_seen` records them).
- `Utils::convertArrayValueToPython`: float16 outputs and state reads come back as float32
  copies.
- `State::writeState`: `transferToMultiArray` into the state buffer, whose shape must match.
- Core ML validates each input against the model description (name and shape; the element type
  is converted).

`install(monkeypatch, fail=...)` puts it in place (and makes `platform` report macOS 15.4 on
arm64); `fail` breaks a step the way Core ML does: "compile", "load", "make_state", "predict"
(every prediction), "chunk" (predictions of the chunk function only), "nan", or a callable
`fail(function, call_index) -> Exception | None` consulted on every prediction.
"""

from __future__ import annotations

import platform
import shutil
import sys
import tempfile
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ondevice.runtime.mil.interpreter import ReferenceModel, ReferenceState

NOT_CONVERTIBLE = "value type not convertible"


def to_multiarray(value: Any) -> np.ndarray:
    """The array Core ML would see for a Python value, by the native layer's rules."""
    if isinstance(value, (list, tuple)):
        value = np.array(value)  # pybind11's cast: int64 / float64 for Python numbers
    if isinstance(value, np.ndarray):
        kind, size = value.dtype.kind, value.dtype.itemsize
        if (kind == "i" and size == 4) or (kind == "f" and size in (4, 8)):
            return value
    print("Error: value type not convertible:")  # what coremltools prints before raising
    raise RuntimeError(NOT_CONVERTIBLE)


def to_python(value: np.ndarray) -> np.ndarray:
    """An output or state read as coremltools returns it: a copy, float16 widened to float32."""
    return np.array(value, np.float32 if value.dtype == np.float16 else value.dtype)


class FakeState:
    """The native `_State`: a reference executor state behind Core ML's read/write rules."""

    def __init__(self, state: ReferenceState, specs: dict) -> None:
        self.state = state
        self.specs = specs

    def read_state(self, name: str) -> np.ndarray:
        if name not in self.specs:
            raise RuntimeError(f"No state named {name}")
        return to_python(self.state.read_state(name))

    def write_state(self, name: str, value: Any) -> None:
        array = to_multiarray(value)
        if name not in self.specs:
            raise RuntimeError(f"No state named {name}")
        shape = self.specs[name][0]
        if tuple(array.shape) != tuple(shape):
            raise RuntimeError(
                f"transferToMultiArray: shape {tuple(array.shape)} does not match the state "
                f"buffer's {tuple(shape)}"
            )
        self.state.write_state(name, array)


class StrictCoreML:
    """The fake native module and a record of what went through it."""

    def __init__(self, fail: str | Callable[[str, int], Exception | None] | None = None):
        self.fail = fail
        self.compiled: list[str] = []
        self.loaded: list[tuple[str, str, str]] = []  # (path, compute units, function)
        self.predictions: list[str] = []  # function names, in order
        self.inputs_seen: list[dict[str, tuple[weakref.ref, np.ndarray]]] = []
        self.states_written: list[tuple[str, np.dtype]] = []
        self._functions: dict[str, dict[str, ReferenceModel]] = {}
        self.module = self._module()

    def functions(self, path: str) -> dict[str, ReferenceModel]:
        if path not in self._functions:
            from ondevice.runtime.mil.package import load_program

            _, prog = load_program(Path(path))
            self._functions[path] = ReferenceModel.load_functions(path, list(prog.functions))
        return self._functions[path]

    def _failure(self, function: str) -> Exception | None:
        fail = self.fail
        if callable(fail):
            return fail(function, len(self.predictions))
        if fail == "predict" or (fail == "chunk" and function == "chunk"):
            return RuntimeError(
                'Error Domain=com.apple.CoreML Code=0 "Failed to evaluate model '
                f'{function} in the Neural Engine"'
            )
        return None

    def _module(self) -> types.ModuleType:
        fake = self

        class _MLModelProxy:
            def __init__(self, path, compute_units, function_name, hints=None, asset=None):
                if fake.fail == "load":
                    raise RuntimeError("Error compiling model: error code -14")
                if not path.rstrip("/").endswith(".mlmodelc"):
                    path = _MLModelProxy.compileModel(path)  # as the native Model() does
                functions = fake.functions(path)
                name = function_name or next(iter(functions))
                if name not in functions:
                    raise RuntimeError(f"function {name!r} not found in {path}")
                fake.loaded.append((path, compute_units, name))
                self.model = functions[name]
                self.function = name

            @staticmethod
            def compileModel(path: str) -> str:
                if fake.fail == "compile":
                    raise RuntimeError('{NSLocalizedDescription = "Failed to compile";}')
                fake.compiled.append(path)
                out = tempfile.mkdtemp(suffix=".mlmodelc")  # as Core ML: a temporary folder
                shutil.rmtree(out)
                shutil.copytree(path, out)
                return out

            @staticmethod
            def maximum_supported_specification_version() -> int:
                return 9  # macOS 15 / iOS 18

            def newState(self) -> FakeState:
                if fake.fail == "make_state":
                    raise Exception("Failed to build the model execution plan")  # bare, as ct
                return FakeState(self.model.make_state(), self.model.state_specs)

            def predict(self, data: dict, state: FakeState | None = None) -> dict:
                arrays = {k: to_multiarray(v) for k, v in data.items()}
                fake.inputs_seen.append({k: (weakref.ref(v), v.copy()) for k, v in arrays.items()})
                for name, (shape, _) in self.model.input_specs.items():
                    if name not in arrays:
                        raise RuntimeError(f"Feature {name} is required but not specified.")
                    if tuple(arrays[name].shape) != tuple(shape):
                        raise RuntimeError(
                            f"MultiArray shape {tuple(arrays[name].shape)} does not match the "
                            f"shape {tuple(shape)} specified in the model description"
                        )
                if self.model.state_specs:
                    if state is None:
                        raise RuntimeError("a stateful model needs a state")
                    if state.specs != self.model.state_specs:
                        raise RuntimeError("the state does not match the model's states")
                error = fake._failure(self.function)
                fake.predictions.append(self.function)
                if error is not None:
                    raise error
                out = self.model.predict(arrays, state.state if state is not None else None)
                if fake.fail == "nan":
                    out = {k: np.full_like(v, np.nan) for k, v in out.items()}
                return {k: to_python(v) for k, v in out.items()}

            def batchPredict(self, batch: list) -> list:
                return [self.predict(d) for d in batch]

        module = types.ModuleType("coremltools.libcoremlpython")
        module._MLModelProxy = _MLModelProxy  # type: ignore[attr-defined]
        module._State = FakeState  # type: ignore[attr-defined]
        return module

    def install(self, monkeypatch) -> StrictCoreML:
        import coremltools.models._compiled_model as ct_compiled
        import coremltools.models.model as ct_model
        import coremltools.models.utils as ct_utils

        monkeypatch.setattr(platform, "system", lambda: "Darwin")
        monkeypatch.setattr(platform, "machine", lambda: "arm64")
        monkeypatch.setattr(platform, "mac_ver", lambda: ("15.4", ("", "", ""), "arm64"))
        monkeypatch.setitem(sys.modules, "coremltools.libcoremlpython", self.module)
        for mod in (ct_compiled, ct_model, ct_utils):
            monkeypatch.setattr(mod, "_macos_version", lambda: (15, 4))
        monkeypatch.setattr(ct_model, "_is_macos", lambda: True)
        monkeypatch.setattr(ct_compiled, "_MLModelProxy", self.module._MLModelProxy)
        monkeypatch.setattr(ct_model, "_MLModelProxy", self.module._MLModelProxy)
        return self


def install(monkeypatch, fail: Any = None) -> StrictCoreML:
    """A `StrictCoreML` in place of coremltools' native module, for the test's duration."""
    return StrictCoreML(fail).install(monkeypatch)
