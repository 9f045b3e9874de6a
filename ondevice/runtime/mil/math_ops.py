"""Arithmetic kernels of the reference executor: element-wise ops, reductions, products (conv,
linear, matmul), softmax and layer norm.

Each factory gets the op's constant inputs (`c`) and the MIL op, and returns a function of the
op's dynamic inputs. Ops whose arithmetic depends on the accumulation mode take a `Numerics`
(and note their intermediates through it when probing); products also take the
`SharedConstants`, which hold their weights' float32 forms once per package.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import numpy as np

from ondevice.runtime.mil.constants import SharedConstants
from ondevice.runtime.mil.numerics import F16, F32, Numerics, Unsupported, product


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


# the error function element-wise, in float64 (the standard library's: numpy has none, and a
# wheel for one function is not worth a dependency; the reference executor runs small drafts)
_ERF = np.vectorize(math.erf, otypes=[np.float64])


def _erf(x):
    x = np.asarray(x)
    return _ERF(x.astype(np.float64)).astype(x.dtype)


_GELU_C = np.sqrt(2.0 / np.pi)


def _gelu(c: dict, op) -> Callable:
    mode = c.pop("mode", "EXACT")

    def fn(x):
        if mode == "EXACT":
            return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))  # in x's dtype
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

    def factory(c: dict, op, num: Numerics) -> Callable:
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


def _conv(c: dict, op, shared: SharedConstants, num: Numerics) -> Callable:
    w = c.pop("weight", None)
    bias = c.pop("bias", None)
    groups = int(c.pop("groups", 1))
    strides = tuple(int(s) for s in np.atleast_1d(c.pop("strides", [1])))
    dil = tuple(int(s) for s in np.atleast_1d(c.pop("dilations", [1])))
    pad = np.atleast_1d(c.pop("pad", [0]))
    c.pop("pad_type", None)
    if w is None or groups != 1 or w.shape[2:] != (1,) * (w.ndim - 2):
        raise Unsupported("conv", "only 1x1 convolutions with a constant weight and groups=1")
    if any(s != 1 for s in strides) or any(d != 1 for d in dil) or np.any(pad):
        raise Unsupported("conv", "only stride 1, dilation 1, no padding")
    w2 = shared.f32(w, lambda a: a.reshape(a.shape[0], -1).astype(F32), "conv")
    b = None if bias is None else np.asarray(bias, F32).reshape(-1, 1)

    def run(x):
        n, cin = x.shape[:2]
        xf = x.reshape(n, cin, -1).astype(F32)
        # 2-D products per batch item: numpy hands those to BLAS (a broadcast 3-D matmul it
        # does not, and runs ~100x slower).
        if n == 1:
            out = product(w2, xf[0], num)[None]
        else:
            out = np.stack([product(w2, xf[i], num) for i in range(n)])
        if b is not None:
            out = out + (b.astype(F16) if out.dtype == F16 else b)
        return out.astype(F16).reshape(n, w2.shape[0], *x.shape[2:])

    return run


def _linear(c: dict, op, shared: SharedConstants, num: Numerics) -> Callable:
    w = c.pop("weight", None)
    bias = c.pop("bias", None)
    if w is None:
        raise Unsupported("linear", "only a constant weight")
    wt = shared.f32(w, lambda a: np.ascontiguousarray(a.astype(F32).T), "linear")
    b = None if bias is None else np.asarray(bias, F32)

    def run(x):
        out = product(np.asarray(x).astype(F32), wt, num)
        if b is not None:
            out = out + (b.astype(F16) if out.dtype == F16 else b)
        return out.astype(F16)

    return run


def _matmul(c: dict, op, shared: SharedConstants, num: Numerics) -> Callable:
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
        return product(a, b, num).astype(F16)

    return run


def _softmax(c: dict, op, num: Numerics) -> Callable:
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


def _layer_norm(c: dict, op, num: Numerics) -> Callable:
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


def _clip(c: dict, op) -> Callable:
    return partial(lambda x, alpha, beta: np.clip(x, alpha, beta).astype(np.asarray(x).dtype), **c)


KERNELS: dict[str, Callable] = {
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
    "clip": _clip,
}
# Products: their weights are shared across functions (and kept as float32).
WEIGHT_KERNELS: dict[str, Callable] = {"conv": _conv, "linear": _linear, "matmul": _matmul}
# Ops whose arithmetic depends on the accumulation mode (and which note intermediates).
ACCUMULATING_KERNELS: dict[str, Callable] = {
    "softmax": _softmax,
    "layer_norm": _layer_norm,
    "reduce_sum": _accumulating_reduce(mean=False),
    "reduce_mean": _accumulating_reduce(mean=True),
}
