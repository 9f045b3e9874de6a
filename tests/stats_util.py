"""Helpers for distribution tests of speculative sampling: a tiny table language model whose
exact next-token distributions are known, and a chi-square goodness-of-fit test.

A `TableEngine` implements the engine protocol with numpy only: the logits after a token depend
on it and the token before it, looked up in a random table. It is fast enough for the tens of
thousands of generations a chi-square test needs, and its exact joint distribution of the first
two generated tokens is computed by enumeration (`exact_joint`)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from scipy.stats import chisquare

from ondevice.speculative.sampling import SamplingParams, Transform


class TableEngine:
    name = "table"

    def __init__(
        self,
        vocab: int = 12,
        seed: int = 0,
        scale: float = 1.5,
        table: np.ndarray | None = None,
        delay: float = 0.0,
        context_length: int = 4096,
    ):
        rng = np.random.default_rng(seed)
        self.table = (
            table if table is not None else rng.standard_normal((vocab, vocab, vocab)) * scale
        ).astype(np.float32)
        self.vocab_size = self.table.shape[-1]
        self.context_length = context_length
        self.delay = delay  # seconds per call: a slow engine, to make a pipeline overlap
        self.tokens: list[int] = []
        self.calls = 0

    def perturbed(self, noise: float, seed: int = 1, **kw) -> TableEngine:
        """A draft that resembles this engine: the same table plus Gaussian noise."""
        rng = np.random.default_rng(seed)
        return TableEngine(table=self.table + noise * rng.standard_normal(self.table.shape), **kw)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.tokens = []

    def _logits(self, i: int) -> np.ndarray:
        prev = self.tokens[i - 1] if i > 0 else 0
        return self.table[prev, self.tokens[i]]

    def feed(self, tokens: Sequence[int], last_only: bool = False) -> np.ndarray:
        if self.delay:
            time.sleep(self.delay)
        self.calls += 1
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        if last_only:
            return self._logits(len(self.tokens) - 1).copy()
        return np.stack([self._logits(i) for i in range(start, len(self.tokens))])

    def trim(self, n: int) -> None:
        del self.tokens[len(self.tokens) - n :]


def exact_joint(engine, prompt: Sequence[int], params: SamplingParams) -> np.ndarray:
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


def chi_square_p(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """p-value of observed `counts` against `probs` (same shape). Cells with a small expected
    count are pooled into one, as the chi-square approximation requires; an observation in a
    cell of probability zero gives p = 0."""
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
