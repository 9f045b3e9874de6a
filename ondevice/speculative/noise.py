"""Randomness keyed by (seed, position): sampling that does not depend on the schedule.

A decoder that draws from one sequential random stream gives different tokens when it drafts a
different number of tokens, or when a pipelined drafter throws away a block it guessed ahead.
Here every random number belongs to a position in the sequence and a purpose, and is derived from
(seed, position, purpose) alone. Whoever asks for it, in whatever round or order, gets the same
number; so the tokens depend only on the prompt, the seed and the models' distributions.

Two sampling rules are built on it:

- `leviathan`: the Leviathan/Chen rule with keyed noise. The draft token at position m is the
  exponential-race (Gumbel-max) sample of q with noise E(m); it is accepted when
  u(m) * q(x) < p(x); a rejected position draws from norm(max(0, p - q)) with its own noise; a
  bonus token at m (no draft there) is the race sample of p with the same E(m), so a drafter's
  guess of the bonus (its own draft at m) matches it as often as possible.
- `coupled`: the token at m is always the race sample of p with E(m); a draft is accepted when
  its own race sample (of q, same noise) equals it. The output is then exactly what plain
  sampling with the same seed gives, whatever was drafted, at some cost in acceptance.

Both are exact. The noise used to decide position m is never used to decide an earlier
position, and the decision whether m holds a draft or the bonus depends only on earlier
positions, so given the committed prefix the token at m is distributed as p(. | prefix).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from ondevice.speculative.accept import residual

# purposes: each gets independent noise at every position
_RACE, _ACCEPT, _RESIDUAL, _RULE = 0, 1, 2, 3
_MASK = (1 << 128) - 1


class PositionNoise:
    """Random numbers keyed by (seed, position, purpose). `seed=None` draws a fresh seed."""

    def __init__(self, seed: int | None, cache_size: int = 64):
        self.seed = int(np.random.SeedSequence().entropy) if seed is None else int(seed) & _MASK
        self._races: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._cache_size = cache_size

    def rng(self, pos: int, purpose: int = _RULE) -> np.random.Generator:
        return np.random.default_rng([self.seed, pos, purpose])

    def uniform(self, pos: int) -> float:
        return float(self.rng(pos, _ACCEPT).random())

    def race(self, pos: int, n: int) -> np.ndarray:
        """n standard exponentials for position `pos` (cached: drafter and verifier share them)."""
        key = (pos, n)
        e = self._races.get(key)
        if e is None:
            e = self.rng(pos, _RACE).standard_exponential(n)
            self._races[key] = e
            if len(self._races) > self._cache_size:
                self._races.popitem(last=False)
        return e

    def race_sample(self, p: np.ndarray, pos: int) -> int:
        """argmax p / E: an exact sample of p (the exponential form of the Gumbel-max trick)."""
        return int(np.argmax(p / self.race(pos, p.shape[-1])))

    def residual_sample(self, r: np.ndarray, pos: int) -> int:
        e = self.rng(pos, _RESIDUAL).standard_exponential(r.shape[-1])
        return int(np.argmax(r / e))


def leviathan(
    drafts: Sequence[int], q: np.ndarray, p: np.ndarray, noise: PositionNoise, start: int
) -> tuple[int, int]:
    """Speculative sampling over a chain whose first draft sits at position `start`.

    q: (K, V) draft distributions, p: (K+1, V) verifier distributions. Returns (accepted, token).
    """
    for i, x in enumerate(drafts):
        px, qx = p[i, x], q[i, x]
        if qx > 0 and noise.uniform(start + i) * qx < px:  # u < p/q without dividing
            continue
        return i, noise.residual_sample(residual(p[i], q[i]), start + i)
    k = len(drafts)
    return k, noise.race_sample(p[k], start + k)


def coupled(
    drafts: Sequence[int], q: np.ndarray | None, p: np.ndarray, noise: PositionNoise, start: int
) -> tuple[int, int]:
    """Gumbel-coupled verification: the verifier's own keyed sample decides every position."""
    for i in range(len(p)):
        y = noise.race_sample(p[i], start + i)
        if i == len(drafts) or drafts[i] != y:
            return i, y
    raise AssertionError("unreachable: p has len(drafts) + 1 rows")


RULES = {"leviathan": leviathan, "coupled": coupled}
