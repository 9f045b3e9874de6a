"""Acceptance rules for a chain of drafted tokens.

Both return `(n, token)`: the first `n` drafts are accepted and `token` is emitted after them
(the verifier's correction at the first rejection, or the bonus token when all pass). So one
verifier pass always yields n + 1 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ondevice.speculative.sampling import sample


def greedy(drafts: Sequence[int], target: Sequence[int]) -> tuple[int, int]:
    """Accept while each draft equals the verifier's argmax; `target` has len(drafts) + 1 ids."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return n, int(target[n])


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)): what the verifier still owes after the draft's proposal was rejected."""
    r = np.maximum(p - q, 0.0)
    s = r.sum()
    # s == 0 only when p == q (up to rounding), where rejection has probability 0; fall back to p.
    return r / s if s > 0 else p


def speculative(
    drafts: Sequence[int], q: np.ndarray, p: np.ndarray, rng: np.random.Generator
) -> tuple[int, int]:
    """Leviathan et al. / Chen et al. speculative sampling over a chain.

    q: (K, V) draft distributions the drafts were sampled from; p: (K+1, V) verifier
    distributions at the same positions plus the bonus position. Accept draft x with probability
    min(1, p(x)/q(x)); at the first rejection sample from norm(max(0, p - q)); if all pass, sample
    the bonus token from p[K]. The emitted tokens are distributed exactly as the verifier's.
    """
    for i, x in enumerate(drafts):
        px, qx = p[i, x], q[i, x]
        if qx > 0 and rng.random() * qx < px:  # u < p/q without dividing
            continue
        return i, sample(residual(p[i], q[i]), rng)
    return len(drafts), sample(p[len(drafts)], rng)
