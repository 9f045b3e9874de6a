"""The sampling transform (temperature, top-k, top-p), applied alike to verifier and draft.

Speculative sampling is lossless for whatever distribution the verifier's logits are mapped to,
as long as the same map is applied to the draft before the acceptance rule. Temperature 0 means
greedy: the distribution is a point mass on the argmax (lowest id on ties, like np.argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Map logits (..., V) to float64 probabilities (..., V) under `params`."""
    logits = np.asarray(logits, dtype=np.float64)
    if params.greedy:
        out = np.zeros_like(logits)
        np.put_along_axis(out, logits.argmax(-1)[..., None], 1.0, axis=-1)
        return out
    z = logits / params.temperature
    V = z.shape[-1]
    if 0 < params.top_k < V:
        # keep the k largest (ties at the threshold are kept, as in most implementations)
        kth = np.partition(z, V - params.top_k, axis=-1)[..., V - params.top_k, None]
        z = np.where(z >= kth, z, -np.inf)
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    if params.top_p < 1.0:
        p = _top_p(p, params.top_p)
    return p


def _top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p, renormalised."""
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, -1)
    cum = np.cumsum(sorted_p, -1)
    # a token is kept if the mass before it is still below top_p
    keep_sorted = (cum - sorted_p) < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    q = np.where(keep, p, 0.0)
    return q / q.sum(-1, keepdims=True)


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a probability vector by inverse CDF (one uniform per draw)."""
    cdf = np.cumsum(p)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(p) - 1))
