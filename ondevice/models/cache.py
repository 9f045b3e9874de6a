"""KV cache with O(1) rollback and keep-a-subset for token trees.

Keys and values live in preallocated buffers indexed by position (as in gpt-fast): rolling back
is just moving `offset` back, and rejected entries are overwritten by the next append.

A numpy buffer's rows past `offset` are kept zero (the rows a rollback forgets are cleared, a few
a round), so the CPU kernel's attention reads its whole key blocks in place instead of copying the
keys into zero-padded blocks every layer and pass (runtime/kernel.py, `_key_blocks`).

The buffers are MLX arrays, or numpy ones where the model hands the cache numpy keys (a model
served by the CPU kernel runs its pass on numpy, runtime/kernel.py "Glue": an MLX buffer would
cost an MLX evaluation per layer and pass). A cache fed the other kind converts its buffers once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

_STEP = 256  # buffers grow in steps of this many positions


class LayerCache:
    """Keys and values of one attention layer: shape (B, n_kv_heads, positions, head_dim)."""

    def __init__(self) -> None:
        self.keys: Any = None  # an mx.array or np.ndarray (see the module)
        self.values: Any = None
        self.offset = 0

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        numpy = isinstance(keys, np.ndarray)
        if self.keys is not None and isinstance(self.keys, np.ndarray) != numpy:
            convert = np.array if numpy else mx.array
            self.keys, self.values = convert(self.keys), convert(self.values)
            self._clear(self.offset, self.keys.shape[2])
        n = keys.shape[2]
        end = self.offset + n
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(keys, values, end)
        self.keys[..., self.offset : end, :] = keys
        self.values[..., self.offset : end, :] = values
        self.offset = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _grow(self, keys: Any, values: Any, needed: int) -> None:
        B, H, _, Dk = keys.shape
        Dv = values.shape[3]
        size = ((needed + _STEP - 1) // _STEP) * _STEP
        zeros = np.zeros if isinstance(keys, np.ndarray) else mx.zeros
        new_k = zeros((B, H, size, Dk), keys.dtype)
        new_v = zeros((B, H, size, Dv), values.dtype)
        if self.keys is not None and self.offset:
            new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_k, new_v

    def _clear(self, start: int, end: int) -> None:
        """Zero a numpy buffer's rows start..end, forgotten (see the module)."""
        if isinstance(self.keys, np.ndarray) and end > start:
            self.keys[..., start:end, :] = 0
            self.values[..., start:end, :] = 0

    def trim(self, n: int) -> None:
        end = self.offset
        self.offset -= min(max(n, 0), self.offset)
        self._clear(self.offset, end)

    def keep(self, n_recent: int, indices: Sequence[int]) -> None:
        """Of the last `n_recent` entries keep those at `indices` (relative, increasing), in order."""
        start, end = self.offset - n_recent, self.offset
        idx = list(indices)
        if idx == list(range(len(idx))):  # a prefix: plain rollback, no copy
            self.offset = start + len(idx)
            self._clear(self.offset, end)
            return
        if idx and isinstance(self.keys, np.ndarray):
            src_np = np.array([start + i for i in idx])
            k, v = self.keys[:, :, src_np], self.values[:, :, src_np]  # copies
            self.keys[..., start : start + len(idx), :] = k
            self.values[..., start : start + len(idx), :] = v
        elif idx:
            src = mx.array([start + i for i in idx])
            k = mx.take(self.keys, src, axis=2)
            v = mx.take(self.values, src, axis=2)
            # Materialise the gathered rows first: slice assignment rewrites the buffer in place,
            # and a lazy gather would then read the already-overwritten rows.
            mx.eval(k, v)
            self.keys[..., start : start + len(idx), :] = k
            self.values[..., start : start + len(idx), :] = v
        self.offset = start + len(idx)
        self._clear(self.offset, end)

    @property
    def buffers(self) -> list[Any]:
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def state(self) -> list[mx.array]:
        """The MLX buffers (what may be lazy; numpy ones never are)."""
        return [a for a in self.buffers if isinstance(a, mx.array)]

    def prefix(self, n: int) -> tuple[mx.array, mx.array] | None:
        """Keys and values of the first n positions as MLX arrays (lazy slices, or copies of
        numpy buffers' rows; None when empty)."""
        if self.keys is None or n <= 0:
            return None
        k, v = self.keys[..., :n, :], self.values[..., :n, :]
        return (mx.array(k), mx.array(v)) if isinstance(k, np.ndarray) else (k, v)

    @classmethod
    def holding(cls, keys: mx.array, values: mx.array) -> LayerCache:
        """A cache whose positions are `keys`/`values` (B, heads, n, d), in fresh buffers."""
        c = cls()
        c.update_and_fetch(keys, values)
        return c


class KVCache:
    """The cache of a whole model: one `LayerCache` per layer, all at the same offset."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(num_layers)]

    def __getitem__(self, i: int) -> LayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def offset(self) -> int:
        return self.layers[0].offset if self.layers else 0

    def trim(self, n: int) -> None:
        """Forget the last `n` positions (O(1))."""
        for c in self.layers:
            c.trim(n)

    def keep(self, n_recent: int, indices: Sequence[int]) -> None:
        """Of the last `n_recent` appended positions keep only `indices` (increasing), in order.

        After this the cache is as if only the kept tokens had been appended after the prefix.
        """
        indices = list(indices)
        if any(b <= a for a, b in zip(indices, indices[1:])) or (
            indices and not 0 <= indices[0] <= indices[-1] < n_recent
        ):
            raise ValueError(f"keep: indices must be increasing and within [0, {n_recent})")
        for c in self.layers:
            c.keep(n_recent, indices)

    @property
    def state(self) -> list[mx.array]:
        return [a for c in self.layers for a in c.state]

    @property
    def nbytes(self) -> int:
        """Memory held by the buffers (allocated positions, not only the used ones)."""
        return sum(a.nbytes for c in self.layers for a in c.buffers)

    def prefix(self, n: int) -> list[tuple[mx.array, mx.array]]:
        """Per layer, keys and values of the first n positions (lazy slices)."""
        if not 0 <= n <= self.offset:
            raise ValueError(f"prefix: {n} positions asked of a cache holding {self.offset}")
        return [p for c in self.layers if (p := c.prefix(n)) is not None]

    @classmethod
    def holding(cls, layers: Sequence[tuple[mx.array, mx.array]]) -> KVCache:
        """A cache whose positions are the given per-layer keys and values, copied into fresh
        buffers (appending to it never writes into the arrays given)."""
        cache = cls(len(layers))
        cache.layers = [LayerCache.holding(k, v) for k, v in layers]
        mx.eval(cache.state)
        return cache

    def copy(self, n: int | None = None) -> KVCache:
        """An independent cache holding the first n positions (default: all)."""
        n = self.offset if n is None else n
        if n == 0:
            return KVCache(len(self.layers))
        return KVCache.holding(self.prefix(n))


class BorrowedCache(KVCache):
    """Some layers of another model's cache: the very `LayerCache` objects of `owner()`'s layers
    `layers`, in order, looked up on every use (the owner's engine may swap its cache: a reset, a
    prompt-cache restore). What a self-draft reads and writes (`proposers/layer_skip.py`): the
    committed sequence's keys and values are the verifier's own."""

    def __init__(self, owner: Callable[[], KVCache], layers: Sequence[int]) -> None:
        self._owner, self._layers = owner, [int(i) for i in layers]

    @property
    def layers(self) -> list[LayerCache]:  # type: ignore[override]
        held = self._owner().layers
        return [held[i] for i in self._layers]
