"""Statistics of the distribution tests: the exact law of the first two generated tokens, and
one chi-square goodness-of-fit test for observed counts against it."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np
from scipy.stats import chisquare

from ondevice.rules.engine import Engine
from ondevice.rules.sampling import SamplingParams, Transform


def exact_joint(engine: Engine, prompt: Sequence[int], params: SamplingParams) -> np.ndarray:
    """P(first two generated tokens = (a, b)) under `engine` alone and the sampling transform
    (with its context), shape (V, V)."""
    V = engine.vocab_size
    tf = Transform(params, V)  # penalties and grammars read the context
    tf.start(prompt)
    engine.reset()
    p1 = tf.probs(engine.feed(list(prompt), last_only=True), list(prompt))
    joint = np.zeros((V, V))
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = tf.probs(engine.feed([a], last_only=True), [*prompt, a])
        engine.trim(1)
        joint[a] = p1[a] * p2
    engine.reset()
    return joint


Cells = Mapping[Hashable, float]


def chi_square_p(
    counts: np.ndarray | Cells, probs: np.ndarray | Cells, min_expected: float = 5.0
) -> float:
    """p-value of Pearson's chi-square test of observed `counts` against `probs`: arrays of the
    same shape, or mappings from cell to count and to probability (a counted cell missing from
    `probs` has probability zero). Cells with an expected count under `min_expected` are pooled
    into one, as the chi-square approximation requires; an observation in a cell of probability
    zero gives p = 0."""
    if isinstance(probs, Mapping):
        assert isinstance(counts, Mapping)
        if any(n and cell not in probs for cell, n in counts.items()):
            return 0.0
        cells = list(probs)
        counts = np.array([counts.get(cell, 0) for cell in cells], np.float64)
        probs = np.array([probs[cell] for cell in cells], np.float64)
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    if counts[probs == 0].sum() > 0:
        return 0.0
    n = counts.sum()
    expected = probs * n
    small = (expected < min_expected) & (probs > 0)
    obs = list(counts[~small & (probs > 0)])
    exp = list(expected[~small & (probs > 0)])
    if small.any():
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
    return float(chisquare(obs, exp).pvalue)
