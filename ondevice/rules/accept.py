"""The acceptance rule of lossless speculative decoding, written once for chains and trees.

Every decoder and the cascade call this module; the exact-enumeration tests
(`tests/test_speculative.py`, `tests/test_tree.py`, over `tests/support/enumeration.py`) check
these very functions.

- Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023): a draft x drawn
  from q is accepted with probability min(1, p(x) / q(x)); at the first rejection the emitted
  token is a sample of the residual norm(max(0, p - q)); when every draft passes, the bonus token
  is a sample of p after the last one. The emitted tokens are distributed exactly as p's.
- The multi-candidate rule for trees (SpecInfer, Miao et al. 2024: recursive rejection sampling;
  EAGLE's rule for deterministic children is the same with point-mass proposals): at a node start
  from r = p and try its draws in order; accept draw x with min(1, r(x) / q(x)) (r(x) for a
  deterministic draw), on rejection replace r by the residual norm(max(0, r - q)). When every
  draw is rejected (or there are none) emit a sample of r. A chain is a one-path tree with one
  draw per node, and then this is Algorithm 1: both are `choose`, one position at a time.
- Greedy acceptance: the longest drafted path whose every token is the verifier's argmax.
- Coupled verification: the token at each position is the verifier's own sample with that
  position's noise; a draft is accepted when it equals it (the output is then plain sampling's).

The random source is passed in, one `Randomness` per decided position (`at(i)`: the i-th
position of a block, or the depth of a tree node): decoders pass the position-keyed noise of
`noise.py`, tests a scripted source that enumerates every outcome, and `Stream` adapts a numpy
generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ondevice.rules.sampling import sample

if TYPE_CHECKING:
    from ondevice.rules.token_tree import TokenTree

__all__ = [
    "RULES",
    "Randomness",
    "Stream",
    "acceptance_probability",
    "choose",
    "coupled",
    "greedy",
    "greedy_tree",
    "multi_draft",
    "residual",
    "sample",
    "speculative",
]

Draw = tuple[int, "np.ndarray | None"]  # (token, the q it was sampled from; None: deterministic)


class Randomness(Protocol):
    """The random numbers that decide one position."""

    def uniform(self) -> float:
        """A uniform in [0, 1) for an acceptance test (each call a new one)."""

    def sample(self, p: np.ndarray) -> int:
        """A sample of p where nothing was tried: the verifier's own token (the bonus)."""

    def resample(self, r: np.ndarray) -> int:
        """A sample of the residual r after a rejection."""


At = Callable[[int], Randomness]  # offset (position in the block, or node depth) -> its source


class Stream:
    """A numpy generator as the source of every position (`at` and `Randomness` at once)."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def __call__(self, offset: int) -> Stream:
        return self

    def uniform(self) -> float:
        return float(self.rng.random())

    def sample(self, p: np.ndarray) -> int:
        return sample(p, self.rng)

    resample = sample


def acceptance_probability(r: np.ndarray, token: int, q: np.ndarray | None) -> float:
    """min(1, r(x)/q(x)) for a draw x sampled from q; r(x) for a deterministic draw (q a point
    mass on x); 0 where q(x) = 0. `r`, `q`: probabilities (V,)."""
    if q is None:
        return float(min(1.0, r[token]))
    qx = q[token]
    return float(min(1.0, r[token] / qx)) if qx > 0 else 0.0


def residual(r: np.ndarray, token: int, q: np.ndarray | None) -> np.ndarray:
    """norm(max(0, r - q)): what the verifier still owes after the draw `token` (from q, or
    deterministic: q a point mass, so r without `token`) was rejected. `r`, `q`: probabilities
    (V,); returns (V,)."""
    if q is None:
        out = r.copy()
        out[token] = 0.0
    else:
        out = np.maximum(r - q, 0.0)
    s = out.sum()
    # s == 0 only when rejection had probability 0 (r == q up to rounding); keep r then.
    return out / s if s > 0 else r


def choose(r: np.ndarray, draws: Sequence[Draw], rand: Randomness) -> tuple[int | None, int]:
    """One position: (index of the accepted draw, its token), or (None, a sample of what is
    left of r once every draw was rejected). `r`: the verifier's probabilities (V,); `draws`:
    (token, q (V,) it was sampled from, or None when deterministic), in order; `rand`: this
    position's random source."""
    for i, (x, q) in enumerate(draws):
        if rand.uniform() < acceptance_probability(r, x, q):
            return i, int(x)
        r = residual(r, x, q)
    return None, (rand.resample(r) if draws else rand.sample(r))


def speculative(
    drafts: Sequence[int], q: np.ndarray | None, p: np.ndarray, at: At
) -> tuple[int, int]:
    """Leviathan et al. 2023, Algorithm 1, over a chain: `q` (K, V) the distributions the drafts
    were sampled from, `p` (K+1, V) the verifier's at the same positions plus the bonus one.
    Returns (accepted count n, the token emitted after drafts[:n])."""
    for i, x in enumerate(drafts):
        assert q is not None
        taken, tok = choose(p[i], [(x, q[i])], at(i))
        if taken is None:
            return i, tok
    k = len(drafts)
    return k, choose(p[k], [], at(k))[1]


def coupled(drafts: Sequence[int], q: np.ndarray | None, p: np.ndarray, at: At) -> tuple[int, int]:
    """Coupled verification: the verifier's own sample decides every position; a draft is
    accepted when it equals it (exact whatever was drafted; with the drafter sampling from the
    same noise, as the chain decoder's does, they agree as often as the two laws allow)."""
    for i in range(len(p)):
        y = at(i).sample(p[i])
        if i == len(drafts) or drafts[i] != y:
            return i, y
    raise AssertionError("unreachable: p has len(drafts) + 1 rows")


RULES: dict[str, Callable[..., tuple[int, int]]] = {"leviathan": speculative, "coupled": coupled}


def multi_draft(
    tree: TokenTree, p: Callable[[int], np.ndarray] | np.ndarray, at: At
) -> tuple[list[int], int]:
    """SpecInfer's recursive rejection sampling down a token tree: `choose` at the root, then at
    the accepted child, and so on. `p` is a (N, V) array or node -> (V,) (so only the visited
    rows are computed); `at(depth)` decides the token after a node at that depth. Exact when
    every draw was made before this call and sampled draws are independent samples of their q.
    Returns the accepted nodes (root's child first) and the token emitted after them."""
    row = p if callable(p) else p.__getitem__
    node, path = 0, []
    while True:
        draws = tree.draws[node]
        taken, tok = choose(row(node), draws, at(tree.depths[node]))
        if taken is None:
            return path, tok
        node = tree.children[node][draws[taken][0]]
        path.append(node)


def greedy(drafts: Sequence[int], target: Sequence[int]) -> tuple[int, int]:
    """Accept while each draft equals the verifier's argmax; `target` has len(drafts) + 1 ids."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return n, int(target[n])


def greedy_tree(tree: TokenTree, target: Sequence[int]) -> tuple[list[int], int]:
    """The longest path whose every token is the verifier's argmax after its parent (`target[i]`:
    the argmax after node i); returns its nodes and the verifier's token after the last."""
    node, path = 0, []
    while (child := tree.children[node].get(int(target[node]))) is not None:
        path.append(child)
        node = child
    return path, int(target[node])
