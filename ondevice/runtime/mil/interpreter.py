"""Run a saved Core ML ML Program in numpy, on any OS: the reference for what the device computes.

`ReferenceModel(path, function_name)` loads the `.mlpackage` back into a MIL program with
coremltools' milproto loader (which works on Linux), then compiles the chosen function into a
flat list of numpy closures:

* constants, and everything computed from constants alone, are evaluated once at load, including
  the `constexpr_*` weight decompression ops (palettized lookup tables, int8 affine/blockwise
  scales), using coremltools' own `materialized_val_inference` so the dense weights are exactly
  what Core ML reconstructs;
* matrix weights are converted once to float32 (numpy has no fast float16 matrix product), and
  weights shared by several functions are stored once;
* each remaining op becomes one closure over pre-resolved slots, so a call runs no graph
  interpretation beyond a loop over closures.

Numerics (float16 storage; the "float32" and "float16" accumulation modes) are in `numerics`; the
op kernels are `math_ops` (arithmetic) and `shape_ops` (shapes and indexing). With `probe=True`
a model records, per op, the largest magnitude of its outputs and of the intermediates its kernel
notes (`magnitudes`): the converter's float16 range probe reads them.

States behave like Core ML's `MLState`: `make_state()` allocates zeroed buffers,
`predict(inputs, state)` reads and updates them. A `slice_update` whose input is the state
buffer itself, with no other consumer left to run, writes in place, so a KV-cache write costs the
size of the new rows rather than a copy of the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ondevice.errors import OndeviceError
from ondevice.runtime.mil import math_ops, shape_ops
from ondevice.runtime.mil.constants import SharedConstants, const_value
from ondevice.runtime.mil.numerics import ACCUMULATIONS, F16, F32, Numerics, Unsupported
from ondevice.runtime.mil.package import load_program

_KERNELS: dict[str, Callable] = {**math_ops.KERNELS, **shape_ops.KERNELS}
_STATE_OPS = ("read_state", "coreml_update_state", "slice_update")


class ReferenceState:
    """The state buffers of one model instance (the numpy counterpart of `MLState`).

    float16 states are held in float32 arrays whose values are all float16 numbers (every write
    is a float16 value), so reads into float32 products need no per-call conversion; the
    `read_state`/`write_state` accessors speak the declared dtype.
    """

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], np.dtype]]):
        self.dtypes = {name: dtype for name, (_, dtype) in specs.items()}
        self.buffers = {
            name: np.zeros(shape, F32 if dtype == F16 else dtype)
            for name, (shape, dtype) in specs.items()
        }

    def read_state(self, name: str) -> np.ndarray:
        return self.buffers[name].astype(self.dtypes[name])

    def write_state(self, name: str, value: np.ndarray) -> None:
        buf = self.buffers[name]
        if value.shape != buf.shape:
            raise OndeviceError(f"state {name!r} has shape {buf.shape}, got {value.shape}.")
        np.copyto(buf, np.asarray(value).astype(self.dtypes[name]), casting="unsafe")


class ReferenceModel:
    """A function of a saved ML Program, run in numpy; `MLModel`'s interface for what we use.

    `predict(inputs, state=None)` returns a dict of numpy arrays (float16 outputs stay float16);
    `make_state()` returns fresh zeroed state buffers. `accumulate` is "float32" (Core ML's
    documented numerics) or "float16" (the emulated worst case); with `probe=True`,
    `magnitudes` maps each op's name to (op type, largest magnitude seen in its outputs and
    intermediates) over every call so far.
    """

    def __init__(
        self,
        path: str | Path,
        function_name: str | None = None,
        *,
        accumulate: str = "float32",
        probe: bool = False,
        _loaded=None,
    ):
        if accumulate not in ACCUMULATIONS:
            raise OndeviceError(
                f"unknown accumulation {accumulate!r}; choose one of {', '.join(ACCUMULATIONS)}."
            )
        self.path = Path(path)
        self.accumulate = accumulate
        self.magnitudes: dict[str, tuple[str, float]] | None = {} if probe else None
        spec, prog = _loaded[:2] if _loaded is not None else load_program(self.path)
        shared = _loaded[2] if _loaded is not None else SharedConstants()
        name = function_name or spec.description.defaultFunctionName or "main"
        if name not in prog.functions:
            raise OndeviceError(
                f"{self.path}: no function {name!r}; the package has "
                f"{', '.join(sorted(prog.functions))}."
            )
        self.function_name = name
        self.user_defined_metadata = dict(spec.description.metadata.userDefined)
        self._compile(prog.functions[name], shared)

    @classmethod
    def load_functions(
        cls, path: str | Path, function_names: Sequence[str], **options: Any
    ) -> dict[str, ReferenceModel]:
        """Several functions of one package, loading it once and sharing their weights;
        `options` are the constructor's (`accumulate`, `probe`)."""
        path = Path(path)
        spec, prog = load_program(path)
        shared = SharedConstants()
        return {n: cls(path, n, _loaded=(spec, prog, shared), **options) for n in function_names}

    # -- compilation -------------------------------------------------------------------------

    def _compile(self, func, shared: SharedConstants) -> None:
        """Fold constants and turn every other op into a step: (kernel, dynamic inputs, slots)."""
        from coremltools.converters.mil.mil import types

        slots = self._read_signature(func, types)
        consts: dict[str, Any] = {}
        ops = list(func.operations)
        order = {op: i for i, op in enumerate(ops)}
        steps: list[tuple[Callable, list[tuple[str, Any]], list[int]]] = []
        step_ops: list[tuple[str, str]] = []
        for op in ops:
            if op.blocks:
                raise self._unsupported(op.op_type, "control flow is not supported")
            if op.op_type == "const":
                consts[op.outputs[0].name] = shared.array(const_value(op.outputs[0].val))
                continue
            if op.op_type.startswith("constexpr_"):
                vals = shared.decompressed(op, self._unsupported)
                for var, val in zip(op.outputs, vals):
                    consts[var.name] = val
                continue
            static, dynamic = self._op_inputs(op, consts, slots)
            try:
                run = self._kernel(op, static, shared, order)
            except Unsupported as e:
                raise self._unsupported(e.op_type, e.detail) from None
            if not dynamic and op.op_type not in _STATE_OPS:
                vals = run()  # everything constant: fold at load
                vals = vals if isinstance(vals, tuple) else (vals,)
                for var, val in zip(op.outputs, vals):
                    consts[var.name] = shared.array(val)
                continue
            for v in op.outputs:
                slots[v.name] = len(slots)
            steps.append((run, dynamic, [slots[v.name] for v in op.outputs]))
            step_ops.append((op.name, op.op_type))

        self._step_ops = step_ops
        self._consts = consts
        self._slots = slots
        self._steps = steps
        self.output_names = [v.name for v in func.outputs]
        self._outputs = [
            (
                v.name,
                ("c", consts[v.name]) if v.name in consts else ("s", slots[v.name]),
                np.dtype(types.nptype_from_builtin(v.dtype)),
            )
            for v in func.outputs
        ]
        self._state_slots = [(name, slots[name]) for name in self.state_specs]
        self._input_slots = [(name, slots[name]) for name in self.input_names]

    def _read_signature(self, func, types) -> dict[str, int]:
        """Set the function's input and state specs; return their slots (in input order)."""
        self.input_names: list[str] = []
        self.input_specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self.state_specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        for name, var in func.inputs.items():
            if types.is_state(var.sym_type):
                dtype = types.nptype_from_builtin(var.sym_type.wrapped_type().get_primitive())
                self.state_specs[name] = (tuple(var.shape), np.dtype(dtype))
            else:
                self.input_names.append(name)
                self.input_specs[name] = (
                    tuple(var.shape),
                    np.dtype(types.nptype_from_builtin(var.dtype)),
                )
        return {name: i for i, name in enumerate(func.inputs)}

    def _op_inputs(
        self, op, consts: dict[str, Any], slots: dict[str, int]
    ) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
        """(constant inputs by name, dynamic inputs as (name, slot or list of parts)) of `op`;
        a list input is constant only if all its parts are."""
        static: dict[str, Any] = {}
        dynamic: list[tuple[str, Any]] = []
        for key, var in op.inputs.items():
            if isinstance(var, (list, tuple)):
                parts = [
                    ("c", consts[v.name]) if v.name in consts else ("s", slots[v.name]) for v in var
                ]
                if all(kind == "c" for kind, _ in parts):
                    static[key] = [val for _, val in parts]
                else:
                    dynamic.append((key, parts))
            elif var.name in consts:
                static[key] = consts[var.name]
            elif var.name in slots:
                dynamic.append((key, slots[var.name]))
            else:
                raise OndeviceError(f"{self.path}: op {op.name} reads unknown value {var.name}.")
        return static, dynamic

    def _unsupported(self, op_type: str, detail: str = "") -> OndeviceError:
        extra = f" ({detail})" if detail else ""
        return OndeviceError(
            f"{self.path} (function {self.function_name}): op {op_type!r}{extra} is not supported "
            "by the reference executor; it runs the ops ondevice-convert emits. Re-convert the "
            "draft with ondevice-convert, or run it with Core ML on macOS."
        )

    def _record(self, name: str, op_type: str, value: float) -> None:
        assert self.magnitudes is not None
        old = self.magnitudes.get(name)
        if old is None or not value <= old[1]:  # NaN counts as the worst
            self.magnitudes[name] = (op_type, value)

    def _kernel(self, op, static: dict, shared: SharedConstants, order: dict) -> Callable:
        t = op.op_type
        note = None if self.magnitudes is None else partial(self._record, op.name, t)
        num = Numerics(f16=self.accumulate == "float16", note=note)
        if t in math_ops.WEIGHT_KERNELS:
            return math_ops.WEIGHT_KERNELS[t](static, op, shared, num)
        if t in math_ops.ACCUMULATING_KERNELS:
            return math_ops.ACCUMULATING_KERNELS[t](static, op, num)
        if t in _KERNELS:
            return _KERNELS[t](static, op)
        if t == "read_state":
            return lambda input: input  # the state buffer itself; writers keep it current
        if t == "coreml_update_state":

            def update(state, value):
                if value is not state:
                    np.copyto(state, value, casting="unsafe")
                return state

            return update
        if t == "slice_update":
            return shape_ops.slice_update(static, op, self._may_write_in_place(op, order))
        raise Unsupported(t, "unknown op")

    @staticmethod
    def _may_write_in_place(op, order: dict) -> bool:
        """True if `op` may overwrite its input: a state buffer nobody else reads afterwards."""
        x = op.inputs["x"]
        if x.op is None or x.op.op_type not in (
            "read_state",
            "coreml_update_state",
            "slice_update",
        ):
            return False
        for child in x.child_ops:
            if child is op:
                continue
            if order.get(child, 1 << 60) > order[op] or child.op_type in shape_ops.VIEW_OPS:
                return False
        return True

    # -- running ----------------------------------------------------------------------------

    def make_state(self) -> ReferenceState:
        return ReferenceState(self.state_specs)

    def predict(self, inputs: dict[str, Any], state: ReferenceState | None = None) -> dict:
        env: list[Any] = [None] * (len(self._slots))
        for name, slot in self._input_slots:
            if name not in inputs:
                raise OndeviceError(
                    f"missing input {name!r} for function {self.function_name}; expected "
                    f"{', '.join(self.input_names)}."
                )
            shape, dtype = self.input_specs[name]
            val = np.asarray(inputs[name])
            if val.shape != shape:
                raise OndeviceError(
                    f"input {name!r} of function {self.function_name} has shape {val.shape}, "
                    f"expected {shape}."
                )
            env[slot] = val.astype(dtype, copy=False)
        if self._state_slots:
            if state is None:
                raise OndeviceError(
                    f"function {self.function_name} is stateful: pass state=model.make_state()."
                )
            for name, slot in self._state_slots:
                env[slot] = state.buffers[name]
        for i, (run, dynamic, outs) in enumerate(self._steps):
            kwargs = {}
            for key, src in dynamic:
                if isinstance(src, int):
                    kwargs[key] = env[src]
                else:
                    kwargs[key] = [env[v] if kind == "s" else v for kind, v in src]
            result = run(**kwargs)
            if len(outs) == 1:
                env[outs[0]] = result
            else:
                for slot, val in zip(outs, result):
                    env[slot] = val
            if self.magnitudes is not None:
                self._probe_outputs(i, [env[slot] for slot in outs])
        return {
            name: np.asarray(val if kind == "c" else env[val]).astype(dtype)  # always a copy
            for name, (kind, val), dtype in self._outputs
        }

    def _probe_outputs(self, step: int, values: list[Any]) -> None:
        name, op_type = self._step_ops[step]
        for v in values:
            v = np.asarray(v)
            if v.dtype.kind == "f" and v.size:
                self._record(name, op_type, float(np.max(np.abs(v))))
