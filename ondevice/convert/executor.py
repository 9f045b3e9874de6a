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

Numerics follow Core ML's float16 programs: every tensor is stored as float16 between ops;
products, softmax, layer norm and reductions accumulate in float32 and round the result to
float16 (as the Neural Engine and GPU accumulate at higher precision), and element-wise ops
round each result to float16.

Two numerics modes (`accumulate=`): "float32" as above, and "float16", which emulates a device
that also accumulates in float16: layer norm, softmax and reductions compute every intermediate
(squares, sums, exponentials) in float16, and products sum blocks of `F16_BLOCK` terms exactly but
round the running sum to float16 after each block. Comparing the two shows how much a model leans
on wide accumulators. With `probe=True` a model records, per op, the largest magnitude of its
outputs and of the intermediates just named (`magnitudes`): `probe_float16_range` runs a package
on real prompts and reports how close each op comes to float16's 65,504.

States behave like Core ML's `MLState`: `make_state()` allocates zeroed buffers,
`predict(inputs, state)` reads and updates them. A `slice_update` whose input is the state
buffer itself, with no other consumer left to run, writes in place, so a KV-cache write costs the
size of the new rows rather than a copy of the cache.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ondevice.errors import OndeviceError

F16, F32 = np.float16, np.float32
METADATA_KEY = "ondevice.draft"  # user-defined metadata entry written by convert_draft
FORMAT_VERSION = 1
_SHARE_MIN_BYTES = 1 << 16  # constants at least this large are deduplicated across functions
FP16_MAX = 65504.0  # the largest finite float16
ACCUMULATIONS = ("float32", "float16")
F16_BLOCK = 32  # products: terms summed exactly before each float16 rounding of the running sum


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


# -- loading ---------------------------------------------------------------------------------------


def _load_program(path: Path):
    """(spec, MIL program with every function) of the package at `path`."""
    from coremltools.converters.mil.frontend.milproto import load as milproto
    from coremltools.models.utils import _try_get_weights_dir_path, load_spec

    if not (path / "Manifest.json").exists():
        raise OndeviceError(f"{path}: not a .mlpackage (no Manifest.json).")
    try:
        spec = load_spec(str(path))
        if spec.WhichOneof("Type") != "mlProgram":
            raise OndeviceError(
                f"{path}: not an ML Program; the reference executor runs only those."
            )
        weights_dir = _try_get_weights_dir_path(str(path)) or ""
        prog = milproto.load(spec, spec.specificationVersion, weights_dir)
    except OndeviceError:
        raise
    except Exception as e:
        raise OndeviceError(
            f"{path}: cannot load the ML Program ({type(e).__name__}: {e}); the package may be "
            "damaged; convert it again."
        ) from None
    return spec, prog


class _SharedConstants:
    """Large constants (and their float32 forms) keyed by content, shared across functions."""

    def __init__(self) -> None:
        self._arrays: dict[tuple, np.ndarray] = {}
        self._f32: dict[tuple, np.ndarray] = {}
        self._dense: dict[tuple, tuple] = {}

    @staticmethod
    def _key(a: np.ndarray) -> tuple:
        digest = hashlib.blake2b(np.ascontiguousarray(a).data, digest_size=16).hexdigest()
        return (a.shape, a.dtype.str, digest)

    def array(self, a: Any) -> Any:
        if not isinstance(a, np.ndarray) or a.nbytes < _SHARE_MIN_BYTES:
            return a
        return self._arrays.setdefault(self._key(a), a)

    def decompressed(self, op, unsupported: Callable[..., Exception]) -> tuple:
        """The dense weights of a `constexpr_*` op, computed once per distinct input."""
        if any(v.val is None for v in op.inputs.values()):
            key: tuple = ("op", id(op))  # fed by another constexpr op: no content key
        else:
            key = (
                op.op_type,
                tuple(
                    (k, self._key(v.val) if isinstance(v.val, np.ndarray) else repr(v.val))
                    for k, v in sorted(op.inputs.items())
                ),
            )
        if key not in self._dense:
            try:
                vals = op.materialized_val_inference()
            except Exception as e:
                raise unsupported(op.op_type, f"cannot decompress ({e})") from None
            vals = vals if isinstance(vals, tuple) else (vals,)
            self._dense[key] = tuple(self.array(np.asarray(v)) for v in vals)
        return self._dense[key]

    def f32(self, a: np.ndarray, transform: Callable[[np.ndarray], np.ndarray], tag: str):
        if a.nbytes < _SHARE_MIN_BYTES:
            return transform(a)
        key = (tag, *self._key(a))
        if key not in self._f32:
            self._f32[key] = transform(a)
        return self._f32[key]


# -- kernels ---------------------------------------------------------------------------------------
# Each factory gets the op's constant inputs (`c`) and returns a function of its dynamic inputs.


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(F16, copy=False) if x.dtype == F32 else x


@dataclass(frozen=True)
class _Numerics:
    """How one op computes: `f16` accumulates in float16; `note(value)` (probing only) records
    the largest magnitude of an intermediate that never becomes an output (a square, a sum)."""

    f16: bool = False
    note: Callable[[float], None] | None = None

    def peak(self, a: np.ndarray) -> None:
        if self.note is not None and a.size:
            self.note(float(np.max(np.abs(a))))


def _f16_sum(parts: Iterable[np.ndarray], num: _Numerics) -> np.ndarray:
    """Sum float32 partial results with a float16 running sum (rounded after every add)."""
    acc: np.ndarray | None = None
    with np.errstate(over="ignore", invalid="ignore"):
        for part in parts:
            acc = part.astype(F16) if acc is None else acc + part.astype(F16)
            num.peak(acc)
    assert acc is not None
    return acc


def _blocks(k: int) -> list[slice]:
    return [slice(i, min(i + F16_BLOCK, k)) for i in range(0, k, F16_BLOCK)]


def _binary(fn: Callable) -> Callable:
    def factory(c: dict, op) -> Callable:
        def run(x, y):
            x, y = np.asarray(x), np.asarray(y)
            if x.dtype == F16 or y.dtype == F16:
                return fn(x.astype(F32), y.astype(F32)).astype(F16)
            return fn(x, y)

        return partial(run, **c)

    return factory


def _compare(fn: Callable) -> Callable:
    return lambda c, op: partial(lambda x, y: fn(np.asarray(x), np.asarray(y)), **c)


def _unary(fn: Callable) -> Callable:
    def factory(c: dict, op) -> Callable:
        def run(x):
            x = np.asarray(x)
            if x.dtype == F16:
                return fn(x.astype(F32)).astype(F16)
            return fn(x)

        return partial(run, **c)

    return factory


def _sigmoid(x):
    return 0.5 * (np.tanh(0.5 * x) + 1.0)  # overflow-free logistic


def _erf(x):
    from scipy.special import erf

    return erf(x)


_GELU_C = np.sqrt(2.0 / np.pi)


def _gelu(c: dict, op) -> Callable:
    mode = c.pop("mode", "EXACT")

    def fn(x):
        if mode == "EXACT":
            return 0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)))
        if mode == "TANH_APPROXIMATION":
            return 0.5 * x * (1.0 + np.tanh(_GELU_C * (x + 0.044715 * x**3)))
        return x * _sigmoid(1.702 * x)

    return _unary(fn)(c, op)


def _reduce(fn: Callable) -> Callable:
    def factory(c: dict, op) -> Callable:
        axes = c.pop("axes", None)
        keep = bool(c.pop("keep_dims", False))
        ax = None if axes is None else tuple(int(a) for a in np.atleast_1d(axes))

        def run(x):
            x = np.asarray(x)
            out = fn(x.astype(F32) if x.dtype == F16 else x, axis=ax, keepdims=keep)
            return np.asarray(out).astype(x.dtype)

        return partial(run, **c)

    return factory


def _accumulating_reduce(mean: bool) -> Callable:
    """reduce_sum / reduce_mean, whose sum is float16 in float16-accumulate mode."""

    def factory(c: dict, op, num: _Numerics) -> Callable:
        axes = c.pop("axes", None)
        keep = bool(c.pop("keep_dims", False))
        ax = None if axes is None else tuple(int(a) for a in np.atleast_1d(axes))

        def run(x):
            x = np.asarray(x)
            if num.f16 and x.dtype == F16:
                with np.errstate(over="ignore", invalid="ignore"):
                    total = np.sum(x, axis=ax, keepdims=keep, dtype=F16)
                    num.peak(total)
                    n = x.size // max(1, total.size)
                    return (total / F16(n)).astype(F16) if mean else total
            xf = x.astype(F32) if x.dtype == F16 else x
            total = np.sum(xf, axis=ax, keepdims=keep)
            num.peak(total)
            if mean:
                total = total / (xf.size // max(1, np.size(total)))
            return np.asarray(total).astype(x.dtype)

        return partial(run, **c)

    return factory


def _argreduce(fn: Callable) -> Callable:
    def factory(c: dict, op) -> Callable:
        axis = int(c.pop("axis", -1))
        keep = bool(c.pop("keep_dims", False))
        dtype = np.dtype(c.pop("output_dtype", "int32"))

        def run(x):
            out = fn(np.asarray(x), axis=axis)
            if keep:
                out = np.expand_dims(out, axis)
            return out.astype(dtype)

        return partial(run, **c)

    return factory


def _product(a: np.ndarray, b: np.ndarray, num: _Numerics) -> np.ndarray:
    """a @ b (2-D or batched, float32 operands holding float16 values), as the mode sums it."""
    if not num.f16:
        return np.matmul(a, b)
    k = a.shape[-1]
    return _f16_sum((np.matmul(a[..., s], b[..., s, :]) for s in _blocks(k)), num)


def _conv(c: dict, op, shared: _SharedConstants, num: _Numerics) -> Callable:
    w = c.pop("weight", None)
    bias = c.pop("bias", None)
    groups = int(c.pop("groups", 1))
    strides = tuple(int(s) for s in np.atleast_1d(c.pop("strides", [1])))
    dil = tuple(int(s) for s in np.atleast_1d(c.pop("dilations", [1])))
    pad = np.atleast_1d(c.pop("pad", [0]))
    c.pop("pad_type", None)
    if w is None or groups != 1 or w.shape[2:] != (1,) * (w.ndim - 2):
        raise _Unsupported("conv", "only 1x1 convolutions with a constant weight and groups=1")
    if any(s != 1 for s in strides) or any(d != 1 for d in dil) or np.any(pad):
        raise _Unsupported("conv", "only stride 1, dilation 1, no padding")
    w2 = shared.f32(w, lambda a: a.reshape(a.shape[0], -1).astype(F32), "conv")
    b = None if bias is None else np.asarray(bias, F32).reshape(-1, 1)

    def run(x):
        n, cin = x.shape[:2]
        xf = x.reshape(n, cin, -1).astype(F32)
        # 2-D products per batch item: numpy hands those to BLAS (a broadcast 3-D matmul it
        # does not, and runs ~100x slower).
        if n == 1:
            out = _product(w2, xf[0], num)[None]
        else:
            out = np.stack([_product(w2, xf[i], num) for i in range(n)])
        if b is not None:
            out = out + (b.astype(F16) if out.dtype == F16 else b)
        return out.astype(F16).reshape(n, w2.shape[0], *x.shape[2:])

    return run


def _linear(c: dict, op, shared: _SharedConstants, num: _Numerics) -> Callable:
    w = c.pop("weight", None)
    bias = c.pop("bias", None)
    if w is None:
        raise _Unsupported("linear", "only a constant weight")
    wt = shared.f32(w, lambda a: np.ascontiguousarray(a.astype(F32).T), "linear")
    b = None if bias is None else np.asarray(bias, F32)

    def run(x):
        out = _product(np.asarray(x).astype(F32), wt, num)
        if b is not None:
            out = out + (b.astype(F16) if out.dtype == F16 else b)
        return out.astype(F16)

    return run


def _matmul(c: dict, op, shared: _SharedConstants, num: _Numerics) -> Callable:
    tx = bool(c.pop("transpose_x", False))
    ty = bool(c.pop("transpose_y", False))

    def prep(a: np.ndarray, t: bool) -> np.ndarray:
        a = np.asarray(a).astype(F32, copy=False)
        return np.swapaxes(a, -1, -2) if t and a.ndim > 1 else a

    cx = None if "x" not in c else shared.f32(c.pop("x"), lambda a: prep(a, tx), f"mmx{tx}")
    cy = None if "y" not in c else shared.f32(c.pop("y"), lambda a: prep(a, ty), f"mmy{ty}")

    def run(x=None, y=None):
        a = cx if x is None else prep(x, tx)
        b = cy if y is None else prep(y, ty)
        if a.ndim < 2 or b.ndim < 2:
            return np.matmul(a, b).astype(F16)
        return _product(a, b, num).astype(F16)

    return run


def _softmax(c: dict, op, num: _Numerics) -> Callable:
    axis = int(c.pop("axis", -1))

    def run(x):
        x = np.asarray(x)
        if num.f16:
            with np.errstate(over="ignore", invalid="ignore"):
                e = np.exp(x.astype(F16) - x.max(axis=axis, keepdims=True).astype(F16))
                total = np.sum(e, axis=axis, keepdims=True, dtype=F16)
                num.peak(total)
                return (e / total).astype(x.dtype)
        xf = x.astype(F32)
        xf -= xf.max(axis=axis, keepdims=True)
        np.exp(xf, out=xf)
        total = xf.sum(axis=axis, keepdims=True)
        num.peak(total)
        xf /= total
        return xf.astype(x.dtype)

    return run


def _layer_norm(c: dict, op, num: _Numerics) -> Callable:
    axes = tuple(int(a) for a in np.atleast_1d(c.pop("axes")))
    gamma, beta = c.pop("gamma", None), c.pop("beta", None)
    eps = float(c.pop("epsilon", 1e-5))
    rank = op.inputs["x"].rank
    norm_axes = tuple(a % rank for a in axes)

    def affine(v):  # gamma/beta have the normalized axes' shape; broadcast them over the rest
        if v is None:
            return None
        full = [op.inputs["x"].shape[a] if a in norm_axes else 1 for a in range(rank)]
        return np.asarray(v, F32).reshape(full)

    g, b = affine(gamma), affine(beta)

    def run_f16(x):
        # Every intermediate in float16, as a float16 accumulator would hold it: the squares
        # and their sum are where large activations overflow.
        x16 = np.asarray(x).astype(F16)
        n = F16(np.prod([x16.shape[a] for a in norm_axes]))
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            mean = np.sum(x16, axis=norm_axes, keepdims=True, dtype=F16) / n
            d = x16 - mean
            sq = d * d
            total = np.sum(sq, axis=norm_axes, keepdims=True, dtype=F16)
            num.peak(sq)
            num.peak(total)
            out = d / np.sqrt(total / n + F16(eps))
            if g is not None:
                out = out * g.astype(F16)
            if b is not None:
                out = out + b.astype(F16)
        return out.astype(np.asarray(x).dtype)

    def run(x):
        if num.f16:
            return run_f16(x)
        xf = np.asarray(x).astype(F32)
        mean = xf.mean(axis=norm_axes, keepdims=True)
        xf -= mean
        sq = xf * xf
        if num.note is not None:
            num.peak(sq)
            num.peak(sq.sum(axis=norm_axes))
        var = np.mean(sq, axis=norm_axes, keepdims=True)
        xf /= np.sqrt(var + eps)
        if g is not None:
            xf *= g
        if b is not None:
            xf += b
        return xf.astype(np.asarray(x).dtype)

    return run


def _static_shape(var) -> tuple[int, ...] | None:
    shape = getattr(var, "shape", None)
    if shape is None or not all(isinstance(d, (int, np.integer)) for d in shape):
        return None
    return tuple(int(d) for d in shape)


# Shape ops: MIL shapes are static here, so parameters are resolved once at load and a call is
# a single numpy operation (per-call parsing of small parameter arrays cost more than the op).


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
        raise _Unsupported(op.op_type, "dynamic output shape")
    c.pop("axes", None)
    return partial(lambda x: np.asarray(x).reshape(out), **c)


def _concat(c: dict, op) -> Callable:
    c.pop("interleave", None)
    if op.inputs.get("interleave") is not None and bool(op.inputs["interleave"].val):
        raise _Unsupported("concat", "interleave=True")
    axis = int(c.pop("axis"))
    return partial(lambda values: np.concatenate(values, axis), **c)


def _split(c: dict, op) -> Callable:
    x_shape = _static_shape(op.inputs["x"])
    if x_shape is None:
        raise _Unsupported("split", "dynamic input shape")
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


def _slice_by_index(c: dict, op) -> Callable:
    def index(shape, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
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

    # A slice of a (float32-held) float16 state that only feeds products stays float32: its
    # values are float16 numbers either way, and the product would convert it anyway.
    keep_f32 = all(
        child.op_type in ("matmul", "conv", "linear") for child in op.outputs[0].child_ops
    )
    x_shape = _static_shape(op.inputs["x"])
    params = ("begin", "end", "stride", "begin_mask", "end_mask", "squeeze_mask")
    if x_shape is not None and all(k in c for k in params if k in op.inputs):
        idx = index(x_shape, **{k: c.pop(k) for k in params if k in c})

        def fixed(x):
            out = np.array(np.asarray(x)[idx])  # a copy: x may be a state written in place
            return out if keep_f32 else _f16(out)

        return partial(fixed, **c)

    def run(x, **kw):
        x = np.asarray(x)
        out = np.array(x[index(x.shape, **kw)])
        return out if keep_f32 else _f16(out)

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
        raise _Unsupported("gather", "batch_dims != 0")
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
        raise _Unsupported("cast", f"dtype {dtype}")
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


def _clip(c: dict, op) -> Callable:
    return partial(lambda x, alpha, beta: np.clip(x, alpha, beta).astype(np.asarray(x).dtype), **c)


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


_FACTORIES: dict[str, Callable] = {
    "add": _binary(np.add),
    "sub": _binary(np.subtract),
    "mul": _binary(np.multiply),
    "real_div": _binary(np.divide),
    "floor_div": _binary(np.floor_divide),
    "mod": _binary(np.mod),
    "pow": _binary(np.power),
    "maximum": _binary(np.maximum),
    "minimum": _binary(np.minimum),
    "equal": _compare(np.equal),
    "not_equal": _compare(np.not_equal),
    "less": _compare(np.less),
    "less_equal": _compare(np.less_equal),
    "greater": _compare(np.greater),
    "greater_equal": _compare(np.greater_equal),
    "logical_and": _compare(np.logical_and),
    "logical_or": _compare(np.logical_or),
    "logical_not": lambda c, op: partial(lambda x: np.logical_not(x), **c),
    "silu": _unary(lambda x: x * _sigmoid(x)),
    "sigmoid": _unary(_sigmoid),
    "relu": _unary(lambda x: np.maximum(x, 0)),
    "tanh": _unary(np.tanh),
    "exp": _unary(np.exp),
    "log": _unary(np.log),
    "sqrt": _unary(np.sqrt),
    "rsqrt": lambda c, op: _unary(lambda x: 1.0 / np.sqrt(x + float(c.pop("epsilon", 1e-12))))(
        c, op
    ),
    "abs": _unary(np.abs),
    "square": _unary(np.square),
    "inverse": lambda c, op: _unary(lambda x: 1.0 / (x + float(c.pop("epsilon", 1e-4))))(c, op),
    "erf": _unary(_erf),
    "gelu": _gelu,
    "reduce_max": _reduce(np.max),
    "reduce_min": _reduce(np.min),
    "reduce_prod": _reduce(np.prod),
    "reduce_sum_square": _reduce(
        lambda x, axis, keepdims: np.sum(x * x, axis=axis, keepdims=keepdims)
    ),
    "reduce_l2_norm": _reduce(
        lambda x, axis, keepdims: np.sqrt(np.sum(x * x, axis=axis, keepdims=keepdims))
    ),
    "reduce_argmax": _argreduce(np.argmax),
    "reduce_argmin": _argreduce(np.argmin),
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
    "clip": _clip,
    "band_part": _band_part,
}
_WEIGHT_FACTORIES = {"conv": _conv, "linear": _linear, "matmul": _matmul}
# Ops whose arithmetic depends on the accumulation mode (and which note intermediates).
_ACCUMULATING_FACTORIES: dict[str, Callable] = {
    "softmax": _softmax,
    "layer_norm": _layer_norm,
    "reduce_sum": _accumulating_reduce(mean=False),
    "reduce_mean": _accumulating_reduce(mean=True),
}
_STATE_OPS = ("read_state", "coreml_update_state", "slice_update")
# Ops whose numpy result may share memory with their input (so the input must not be mutated
# in place while the result is still to be read).
_VIEW_OPS = {"reshape", "transpose", "expand_dims", "squeeze", "identity", "split", "select"}


class _Unsupported(Exception):
    def __init__(self, op_type: str, detail: str):
        super().__init__(f"{op_type}: {detail}")
        self.op_type, self.detail = op_type, detail


def _slice_update_factory(c: dict, op, in_place: bool) -> Callable:
    def run(x, update, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
        x = np.asarray(x)
        idx: list[Any] = []
        for i in range(x.ndim):
            b = None if begin_mask is not None and begin_mask[i] else int(begin[i])
            e = None if end_mask is not None and end_mask[i] else int(end[i])
            s = 1 if stride is None else int(stride[i])
            idx.append(
                int(begin[i]) if squeeze_mask is not None and squeeze_mask[i] else slice(b, e, s)
            )
        target = x if in_place else x.copy()
        region = target[tuple(idx)]
        upd = np.asarray(update)
        if region.size != upd.size:
            raise OndeviceError(
                f"slice_update {op.name}: the update {upd.shape} does not fit [{list(begin)}, "
                f"{list(end)}) of {x.shape} (a position beyond the model's context?)."
            )
        target[tuple(idx)] = upd.reshape(region.shape)
        return target

    return partial(run, **c)


# -- the model -------------------------------------------------------------------------------------


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
        spec, prog = _loaded[:2] if _loaded is not None else _load_program(self.path)
        shared = _loaded[2] if _loaded is not None else _SharedConstants()
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
        spec, prog = _load_program(path)
        shared = _SharedConstants()
        return {n: cls(path, n, _loaded=(spec, prog, shared), **options) for n in function_names}

    # -- compilation -------------------------------------------------------------------------

    def _compile(self, func, shared: _SharedConstants) -> None:
        from coremltools.converters.mil.mil import types

        self.input_names: list[str] = []
        self.input_specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self.state_specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        slots: dict[str, int] = {}
        consts: dict[str, Any] = {}

        def new_slot(name: str) -> int:
            slots[name] = len(slots)
            return slots[name]

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
            new_slot(name)

        ops = list(func.operations)
        order = {op: i for i, op in enumerate(ops)}
        steps: list[tuple[Callable, list[tuple[str, Any]], list[int]]] = []
        step_ops: list[tuple[str, str]] = []
        for op in ops:
            if op.blocks:
                raise self._unsupported(op.op_type, "control flow is not supported")
            if op.op_type == "const":
                consts[op.outputs[0].name] = shared.array(_const_value(op.outputs[0].val))
                continue
            if op.op_type.startswith("constexpr_"):
                vals = shared.decompressed(op, self._unsupported)
                for var, val in zip(op.outputs, vals):
                    consts[var.name] = val
                continue

            static: dict[str, Any] = {}
            dynamic: list[tuple[str, Any]] = []
            for key, var in op.inputs.items():
                if isinstance(var, (list, tuple)):
                    parts = [
                        ("c", consts[v.name]) if v.name in consts else ("s", slots[v.name])
                        for v in var
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
                    raise OndeviceError(
                        f"{self.path}: op {op.name} reads unknown value {var.name}."
                    )

            try:
                run = self._kernel(op, static, shared, order)
            except _Unsupported as e:
                raise self._unsupported(e.op_type, e.detail) from None

            outs = op.outputs
            if not dynamic and op.op_type not in _STATE_OPS:
                vals = run()  # everything constant: fold at load
                vals = vals if isinstance(vals, tuple) else (vals,)
                for var, val in zip(outs, vals):
                    consts[var.name] = shared.array(val)
                continue
            steps.append((run, dynamic, [new_slot(v.name) for v in outs]))
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

    def _kernel(self, op, static: dict, shared: _SharedConstants, order: dict) -> Callable:
        t = op.op_type
        note = None if self.magnitudes is None else partial(self._record, op.name, t)
        num = _Numerics(f16=self.accumulate == "float16", note=note)
        if t in _WEIGHT_FACTORIES:
            return _WEIGHT_FACTORIES[t](static, op, shared, num)
        if t in _ACCUMULATING_FACTORIES:
            return _ACCUMULATING_FACTORIES[t](static, op, num)
        if t in _FACTORIES:
            return _FACTORIES[t](static, op)
        if t == "read_state":
            return lambda input: input  # the state buffer itself; writers keep it current
        if t == "coreml_update_state":

            def update(state, value):
                if value is not state:
                    np.copyto(state, value, casting="unsafe")
                return state

            return update
        if t == "slice_update":
            return _slice_update_factory(static, op, self._may_write_in_place(op, order))
        raise _Unsupported(t, "unknown op")

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
            if order.get(child, 1 << 60) > order[op] or child.op_type in _VIEW_OPS:
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


def _const_value(val: Any) -> Any:
    if isinstance(val, np.ndarray):
        return val
    if isinstance(val, (bool, int, float, str, np.generic)):
        return val
    if isinstance(val, (list, tuple)):
        return np.asarray(val)
    return val


def read_description(path: str | Path) -> dict:
    """The description `convert_draft` stored in a package's metadata (reads only the spec)."""
    from coremltools.models.utils import load_spec

    path = Path(path)
    if not (path / "Manifest.json").exists():
        raise OndeviceError(f"{path}: not a .mlpackage (no Manifest.json).")
    try:
        spec = load_spec(str(path))
    except Exception as e:
        raise OndeviceError(f"{path}: cannot read the Core ML package ({e}).") from None
    raw = spec.description.metadata.userDefined.get(METADATA_KEY)
    if raw is None:
        raise OndeviceError(
            f"{path}: no {METADATA_KEY!r} metadata; this package was not written by "
            "ondevice-convert. Convert the draft again."
        )
    meta = json.loads(raw)
    if meta.get("format_version") != FORMAT_VERSION:
        raise OndeviceError(
            f"{path}: draft format version {meta.get('format_version')} is not supported "
            f"(this ondevice reads version {FORMAT_VERSION}); convert the draft again."
        )
    return meta


# -- float16 range probe ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RangeReport:
    """Largest magnitudes per op over a probe run, largest first."""

    peaks: list[tuple[str, str, float]]  # (op name, op type, largest magnitude)
    tokens: int  # tokens the probe fed

    @property
    def peak(self) -> float:
        return self.peaks[0][2] if self.peaks else 0.0

    def over(self, limit: float) -> list[tuple[str, str, float]]:
        return [p for p in self.peaks if not p[2] <= limit]  # NaN and inf count as over

    def describe(self, n: int = 5) -> str:
        return ", ".join(f"{name} ({op_type}) {value:,.0f}" for name, op_type, value in self.peaks[:n])


def probe_float16_range(
    path: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    decode_steps: int = 8,
    accumulate: str = "float32",
) -> RangeReport:
    """Run a converted draft on `prompts` (token ids: prefill through `chunk`, then
    `decode_steps` greedy steps through `decode`) and report each op's largest magnitude,
    intermediates included: what the device's float16 must hold for these inputs."""
    meta = read_description(path)
    models = ReferenceModel.load_functions(
        path, ["decode", "chunk"], accumulate=accumulate, probe=True
    )
    chunk, names, context = int(meta["chunk"]), list(meta["logits"]), int(meta["context"])
    shape = tuple(meta["kv_cache"]["shape"])
    fed = 0
    for prompt in prompts:
        ids = [int(t) for t in prompt][: max(1, context - decode_steps)]
        state = models["decode"].make_state() if meta["kv"] == "state" else None
        caches = {"key_cache": np.zeros(shape, F16), "value_cache": np.zeros(shape, F16)}

        def call(function: str, tokens: list[int], pos: int, state=state, caches=caches):
            inputs: dict[str, Any] = {
                "input_ids": np.array([tokens], np.int32),
                "position": np.array([pos], np.int32),
            }
            if state is None:
                inputs.update(caches)
            out = models[function].predict(inputs, state)
            if state is None:
                end = pos + len(tokens)
                caches["key_cache"][:, :, pos:end] = out["new_keys"]
                caches["value_cache"][:, :, pos:end] = out["new_values"]
            return np.concatenate([np.asarray(out[n], F32)[0, -1] for n in names])

        pos = 0
        while len(ids) - pos >= chunk:
            logits = call("chunk", ids[pos : pos + chunk], pos)
            pos += chunk
        while pos < len(ids):
            logits = call("decode", ids[pos : pos + 1], pos)
            pos += 1
        for _ in range(min(decode_steps, context - pos)):
            logits = call("decode", [int(np.argmax(logits))], pos)
            pos += 1
        fed += pos
    merged: dict[str, tuple[str, float]] = {}
    for model in models.values():
        assert model.magnitudes is not None
        for name, (op_type, value) in model.magnitudes.items():
            if name not in merged or not value <= merged[name][1]:
                merged[name] = (op_type, value)
    peaks = sorted(
        ((n, t, v) for n, (t, v) in merged.items()),
        key=lambda p: -np.inf if np.isnan(p[2]) else -p[2],  # NaN first, then inf, then values
    )
    return RangeReport(peaks=peaks, tokens=fed)
