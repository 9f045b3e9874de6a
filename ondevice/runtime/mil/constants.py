"""A program's constants, held once: large arrays (and their float32 forms) keyed by content.

The two functions of a draft package (`decode`, `chunk`) read the same weights; loading them
through one `SharedConstants` stores each weight, its float32 copy for products, and the dense
form of each compressed (`constexpr_*`) weight once. Decompression uses coremltools' own
`materialized_val_inference`, so the dense weights are exactly what Core ML reconstructs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

_SHARE_MIN_BYTES = 1 << 16  # constants at least this large are deduplicated across functions


class SharedConstants:
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


def const_value(val: Any) -> Any:
    """A `const` op's value as the kernels take it: lists and tuples become arrays."""
    if isinstance(val, (list, tuple)):
        return np.asarray(val)
    return val
