"""How the reference executor computes: float16 storage, the two accumulation modes, products.

Numerics follow Core ML's float16 programs: every tensor is stored as float16 between ops;
products, softmax, layer norm and reductions accumulate in float32 and round the result to
float16 (as the Neural Engine and GPU accumulate at higher precision), and element-wise ops
round each result to float16.

Two numerics modes (`accumulate=`): "float32" as above, and "float16", which emulates a device
that also accumulates in float16: layer norm, softmax and reductions compute every intermediate
(squares, sums, exponentials) in float16, and products sum blocks of `F16_BLOCK` terms exactly but
round the running sum to float16 after each block. Comparing the two shows how much a model leans
on wide accumulators.

Also here: `Unsupported`, what a kernel factory raises for an op (or a form of it) the executor
cannot run; the model turns it into an error naming the package and function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

F16, F32 = np.float16, np.float32
FP16_MAX = 65504.0  # the largest finite float16
ACCUMULATIONS = ("float32", "float16")
F16_BLOCK = 32  # products: terms summed exactly before each float16 rounding of the running sum


class Unsupported(Exception):
    def __init__(self, op_type: str, detail: str):
        super().__init__(f"{op_type}: {detail}")
        self.op_type, self.detail = op_type, detail


def to_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(F16, copy=False) if x.dtype == F32 else x


@dataclass(frozen=True)
class Numerics:
    """How one op computes: `f16` accumulates in float16; `note(value)` (probing only) records
    the largest magnitude of an intermediate that never becomes an output (a square, a sum)."""

    f16: bool = False
    note: Callable[[float], None] | None = None

    def peak(self, a: np.ndarray) -> None:
        if self.note is not None and a.size:
            self.note(float(np.max(np.abs(a))))


def _f16_sum(parts: Iterable[np.ndarray], num: Numerics) -> np.ndarray:
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


def product(a: np.ndarray, b: np.ndarray, num: Numerics) -> np.ndarray:
    """a @ b (2-D or batched, float32 operands holding float16 values), as the mode sums it."""
    if not num.f16:
        return np.matmul(a, b)
    k = a.shape[-1]
    return _f16_sum((np.matmul(a[..., s], b[..., s, :]) for s in _blocks(k)), num)
