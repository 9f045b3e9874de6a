"""Exact enumeration of a randomised function's law: `law(fn)` runs fn(rand) over every outcome
of its random source and returns {result: probability}, exactly (up to float rounding).

`rand` is a `Randomness` (`ondevice.rules.accept`) and its `at` at once (`rand(i)` is
`rand`), so it goes wherever the acceptance rule takes its random source: the rule the decoders
run is the rule enumerated here.

- `sample(p)` / `resample(r)`: every token t with p(t) > 0 is an outcome of weight p(t).
- `uniform()`: the rule uses a uniform only as `uniform() < threshold`, with the threshold fixed
  before the uniform is drawn; so the first run past the script hands out a probe that records
  the thresholds it is compared with, [0, 1] is split at them, and one run per interval (at its
  midpoint, weighted by its width) covers the interval exactly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


class _Need(Exception):
    """The run asked for a random outcome past its script."""


class _Probe(float):
    """A uniform whose `<` comparisons record the thresholds."""

    def __new__(cls, value: float, seen: list[float]) -> _Probe:
        probe = super().__new__(cls, value)
        probe.seen = seen
        return probe

    def __lt__(self, other: Any) -> bool:
        self.seen.append(float(other))
        return float(self) < float(other)


class Scripted:
    """Plays back a script of outcomes (uniforms as floats, samples as token ids); past it, the
    first request is a branch point (`branch`) and the run ends at the next request."""

    def __init__(self, script: list[float | int]) -> None:
        self.script, self.i = script, 0
        self.branch: tuple[str, Any] | None = None  # ("uniform", thresholds) | ("sample", p)

    def __call__(self, offset: int) -> Scripted:
        return self

    def _next(self) -> float | int | None:
        if self.i < len(self.script):
            self.i += 1
            return self.script[self.i - 1]
        if self.branch is not None:
            raise _Need
        return None

    def uniform(self) -> float:
        value = self._next()
        if value is not None:
            return float(value)
        seen: list[float] = []
        self.branch = ("uniform", seen)
        return _Probe(0.5, seen)

    def sample(self, p: np.ndarray) -> int:
        value = self._next()
        if value is not None:
            return int(value)
        p = np.asarray(p, np.float64)
        self.branch = ("sample", p / p.sum())
        raise _Need

    resample = sample


def law(fn: Callable[[Scripted], Any]) -> Counter:
    """{fn's result: its probability} over every outcome of the random source fn is given."""
    out: Counter = Counter()

    def rec(script: list[float | int], weight: float) -> None:
        rand = Scripted(script)
        try:
            result = fn(rand)
        except _Need:
            result = None
        if rand.branch is None:
            out[result] += weight
            return
        kind, data = rand.branch
        if kind == "sample":
            for token, pt in enumerate(data):
                if pt > 0:
                    rec([*script, token], weight * pt)
            return
        cuts = np.unique(np.clip([0.0, 1.0, *data], 0, 1))
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            if hi > lo:
                rec([*script, (lo + hi) / 2], weight * (hi - lo))

    rec([], 1.0)
    return out


def random_dist(rng: np.random.Generator, v: int, zeros: int = 0) -> np.ndarray:
    """A random distribution over v tokens, `zeros` of them impossible."""
    x = rng.random(v) ** 2
    x[rng.choice(v, zeros, replace=False)] = 0
    return x / x.sum()


def assert_emits_the_verifier_law(joint: Mapping, p1: np.ndarray, p2: Mapping) -> None:
    """`joint`: {(first token, second token, drafts accepted): probability}. The first token
    must follow p1 exactly and the second, given the first was an accepted draft, p2[first]."""
    V = len(p1)
    first = np.zeros(V)
    for (x1, _, _), pr in joint.items():
        first[x1] += pr
    np.testing.assert_allclose(first, p1, atol=1e-12)
    for x1 in range(V):
        cond = np.zeros(V)
        for (y1, x2, n), pr in joint.items():
            if y1 == x1 and n >= 1:
                cond[x2] += pr
        if cond.sum() > 1e-12:
            np.testing.assert_allclose(cond / cond.sum(), p2[x1], atol=1e-9)
