"""Shape and indexing kernels of the reference executor: reshapes, slices, gathers, casts, and
the `slice_update` that writes a KV cache.

MIL shapes are static in the programs the converter writes, so parameters are resolved once at
load and a call is a single numpy operation (per-call parsing of small parameter arrays cost
more than the op). Factories take the op's constant inputs (`c`) and the MIL op, and return a
function of the op's dynamic inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from ondevice.errors import OndeviceError
from ondevice.runtime.mil.numerics import F16, F32, Unsupported, to_f16


def _static_shape(var) -> tuple[int, ...] | None:
    shape = getattr(var, "shape", None)
    if shape is None or not all(isinstance(d, (int, np.integer)) for d in shape):
        return None
    return tuple(int(d) for d in shape)


def _reshape(c: dict, op) -> Callable:
    out = _static_shape(op.outputs[0])
    if out is not None:
        c.pop("shape", None)
        return partial(lambda x: np.asarray(x).reshape(out), **c)

    def run(x, shape):
        x = np.asarray(x)
        shape = [int(s) if int(s) != 0 else x.shape[i] for i, s in enumerate(np.atleast_1d(shape))]
        return x.reshape(shape)

    return partial(run, **c)


def _transpose(c: dict, op) -> Callable:
    if "perm" in c:
        perm = tuple(int(p) for p in c.pop("perm"))
        return partial(lambda x: np.transpose(x, perm), **c)
    return partial(lambda x, perm: np.transpose(x, tuple(int(p) for p in perm)), **c)


def _expand_dims(c: dict, op) -> Callable:  # and squeeze: a reshape to the known output shape
    out = _static_shape(op.outputs[0])
    if out is None:
        raise Unsupported(op.op_type, "dynamic output shape")
    c.pop("axes", None)
    return partial(lambda x: np.asarray(x).reshape(out), **c)


def _concat(c: dict, op) -> Callable:
    c.pop("interleave", None)
    if op.inputs.get("interleave") is not None and bool(op.inputs["interleave"].val):
        raise Unsupported("concat", "interleave=True")
    axis = int(c.pop("axis"))
    return partial(lambda values: np.concatenate(values, axis), **c)


def _split(c: dict, op) -> Callable:
    x_shape = _static_shape(op.inputs["x"])
    if x_shape is None:
        raise Unsupported("split", "dynamic input shape")
    axis = int(c.pop("axis")) % len(x_shape)
    c.pop("num_splits", None)
    c.pop("split_sizes", None)
    slices, start = [], 0
    for var in op.outputs:  # the outputs' static shapes give the split points
        n = var.shape[axis]
        slices.append((slice(None),) * axis + (slice(start, start + n),))
        start += n

    def run(x):
        x = np.asarray(x)
        return tuple(x[s] for s in slices)

    return partial(run, **c)


def _index(shape, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    """The numpy index of MIL's strided slice (`slice_by_index`, `slice_update`) of `shape`."""
    idx: list[Any] = []
    for i in range(len(shape)):
        b = None if begin_mask is not None and begin_mask[i] else int(begin[i])
        e = None if end_mask is not None and end_mask[i] else int(end[i])
        s = 1 if stride is None else int(stride[i])
        if squeeze_mask is not None and squeeze_mask[i]:
            idx.append(int(begin[i]))
        else:
            idx.append(slice(b, e, s))
    return tuple(idx)


def _slice_by_index(c: dict, op) -> Callable:
    # A slice of a (float32-held) float16 state that only feeds products stays float32: its
    # values are float16 numbers either way, and the product would convert it anyway.
    keep_f32 = all(
        child.op_type in ("matmul", "conv", "linear") for child in op.outputs[0].child_ops
    )
    x_shape = _static_shape(op.inputs["x"])
    params = ("begin", "end", "stride", "begin_mask", "end_mask", "squeeze_mask")
    if x_shape is not None and all(k in c for k in params if k in op.inputs):
        idx = _index(x_shape, **{k: c.pop(k) for k in params if k in c})

        def fixed(x):
            out = np.array(np.asarray(x)[idx])  # a copy: x may be a state written in place
            return out if keep_f32 else to_f16(out)

        return partial(fixed, **c)

    def run(x, **kw):
        x = np.asarray(x)
        out = np.array(x[_index(x.shape, **kw)])
        return out if keep_f32 else to_f16(out)

    return partial(run, **c)


def _slice_by_size(c: dict, op) -> Callable:
    def run(x, begin, size):
        x = np.asarray(x)
        idx = []
        for i in range(x.ndim):
            b = int(begin[i])
            n = int(size[i])
            idx.append(slice(b, None if n == -1 else b + n))
        out = x[tuple(idx)]
        if any(int(s) != -1 and out.shape[i] != int(s) for i, s in enumerate(size)):
            raise OndeviceError(
                f"slice_by_size {op.name}: begin {list(begin)} size {list(size)} runs past "
                f"shape {x.shape} (a position beyond the model's context?)."
            )
        return np.array(out)

    return partial(run, **c)


def _gather(c: dict, op) -> Callable:
    if int(c.pop("batch_dims", 0)) != 0:
        raise Unsupported("gather", "batch_dims != 0")
    c.pop("validate_indices", None)

    def run(x, indices, axis=0):
        x = np.asarray(x)
        ind = np.asarray(indices).astype(np.int64)
        ind = np.where(ind < 0, ind + x.shape[int(axis)], ind)
        return np.take(x, ind, axis=int(axis))

    return partial(run, **c)


def _gather_along_axis(c: dict, op) -> Callable:
    c.pop("validate_indices", None)

    def run(x, indices, axis=0):
        return np.take_along_axis(np.asarray(x), np.asarray(indices).astype(np.int64), int(axis))

    return partial(run, **c)


_CAST_TYPES = {
    "fp16": F16,
    "fp32": F32,
    "int32": np.int32,
    "int16": np.int16,
    "uint16": np.uint16,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
}


def _cast(c: dict, op) -> Callable:
    dtype = c.pop("dtype")
    if dtype not in _CAST_TYPES:
        raise Unsupported("cast", f"dtype {dtype}")
    target = _CAST_TYPES[dtype]
    return partial(lambda x: np.asarray(x).astype(target), **c)


def _select(c: dict, op) -> Callable:
    return partial(lambda cond, a, b: np.where(np.asarray(cond), a, b), **c)


def _tile(c: dict, op) -> Callable:
    return partial(lambda x, reps: np.tile(x, tuple(int(r) for r in reps)), **c)


def _fill(c: dict, op) -> Callable:
    dtype = op.outputs[0].dtype
    from coremltools.converters.mil.mil import types

    np_dtype = types.nptype_from_builtin(dtype)
    return partial(
        lambda shape, value=0.0: np.full(tuple(int(s) for s in shape), value, np_dtype), **c
    )


def _range_1d(c: dict, op) -> Callable:
    return partial(lambda start, end, step: np.arange(start, end, step), **c)


def _shape(c: dict, op) -> Callable:
    return partial(lambda x: np.array(np.shape(x), np.int32), **c)


def _identity(c: dict, op) -> Callable:
    return partial(lambda x: x, **c)


def _band_part(c: dict, op) -> Callable:
    def run(x, lower=-1, upper=-1):
        x = np.asarray(x)
        m, n = x.shape[-2:]
        i, j = np.arange(m)[:, None], np.arange(n)[None, :]
        keep = np.ones((m, n), bool)
        if lower >= 0:
            keep &= i - j <= lower
        if upper >= 0:
            keep &= j - i <= upper
        return np.where(keep, x, np.zeros((), x.dtype))

    return partial(run, **c)


def slice_update(c: dict, op, in_place: bool) -> Callable:
    """`slice_update`; with `in_place` (the interpreter decides) it writes into `x` itself."""

    def run(x, update, begin, end, **masks):
        x = np.asarray(x)
        idx = _index(x.shape, begin, end, **masks)
        target = x if in_place else x.copy()
        region = target[idx]
        upd = np.asarray(update)
        if region.size != upd.size:
            raise OndeviceError(
                f"slice_update {op.name}: the update {upd.shape} does not fit [{list(begin)}, "
                f"{list(end)}) of {x.shape} (a position beyond the model's context?)."
            )
        target[idx] = upd.reshape(region.shape)
        return target

    return partial(run, **c)


KERNELS: dict[str, Callable] = {
    "reshape": _reshape,
    "transpose": _transpose,
    "expand_dims": _expand_dims,
    "squeeze": _expand_dims,
    "concat": _concat,
    "split": _split,
    "slice_by_index": _slice_by_index,
    "slice_by_size": _slice_by_size,
    "gather": _gather,
    "gather_along_axis": _gather_along_axis,
    "cast": _cast,
    "select": _select,
    "tile": _tile,
    "fill": _fill,
    "range_1d": _range_1d,
    "shape": _shape,
    "identity": _identity,
    "band_part": _band_part,
}
# Ops whose numpy result may share memory with their input (so the input must not be mutated
# in place while the result is still to be read).
VIEW_OPS = {"reshape", "transpose", "expand_dims", "squeeze", "identity", "split", "select"}
