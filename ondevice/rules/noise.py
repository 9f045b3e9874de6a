"""The position-keyed random source: sampling that does not depend on the schedule.

A decoder that draws from one sequential random stream gives different tokens when it drafts a
different number of tokens, or when a pipelined drafter throws away a block it guessed ahead.
Here every random number belongs to a position in the sequence and a purpose, and is derived from
(seed, position, purpose) alone. Whoever asks for it, in whatever round or order, gets the same
number; so the tokens depend only on the prompt, the seed, the models' distributions and what
was drafted (which itself depends only on tokens and on these numbers).

Purposes at position m: the race (n standard exponentials E(m): the chain's draft token is the
exponential-race, Gumbel-max, sample argmax q / E(m), and the verifier's own token where nothing
was drafted is argmax p / E(m), so a drafter's guess of that bonus matches it as often as
possible); the acceptance uniforms; the residual's own exponentials after a rejection; and the
draws of sampled proposals (tree children, the cascade's draft chain) at m. The acceptance rule
(`accept.py`) takes `at(pos)`, the `Randomness` of one position.

Exactness: the numbers that decide position m are never used to decide an earlier position, and
whether m is decided against a draft or not depends only on earlier positions, so given the
committed prefix the token at m is distributed as p(. | prefix).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from ondevice.rules.accept import Randomness

# purposes: each gets independent noise at every position
_RACE, _ACCEPT, _RESIDUAL, _RULE, _DRAWS = 0, 1, 2, 3, 4
_MASK = (1 << 128) - 1


class PositionNoise:
    """Random numbers keyed by (seed, position, purpose). `seed=None` draws a fresh seed."""

    def __init__(self, seed: int | None, cache_size: int = 64):
        self.seed = int(np.random.SeedSequence().entropy) if seed is None else int(seed) & _MASK
        self._races: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._cache_size = cache_size

    def rng(self, pos: int, purpose: int = _RULE) -> np.random.Generator:
        return np.random.default_rng([self.seed, pos, purpose])

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

    def at(self, pos: int) -> Randomness:
        """The source that decides position `pos`."""
        return _Position(self, pos)

    def offsets(self, start: int) -> Callable[[int], Randomness]:
        """`at` for a block whose first decided position is `start`."""
        return lambda i: _Position(self, start + i)

    def draws(self, pos: int) -> np.random.Generator:
        """The generator of sampled proposals for position `pos` (i.i.d. draws in turn)."""
        return self.rng(pos, _DRAWS)


class _Position:
    """`Randomness` of one position: keyed uniforms, the race sample, the residual's noise."""

    def __init__(self, noise: PositionNoise, pos: int):
        self.noise, self.pos = noise, pos
        self._uniforms: np.random.Generator | None = None

    def uniform(self) -> float:
        if self._uniforms is None:
            self._uniforms = self.noise.rng(self.pos, _ACCEPT)
        return float(self._uniforms.random())

    def sample(self, p: np.ndarray) -> int:
        return self.noise.race_sample(p, self.pos)

    def resample(self, r: np.ndarray) -> int:
        return self.noise.residual_sample(r, self.pos)
