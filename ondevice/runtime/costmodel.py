"""Expected tokens per second of speculative decoding, from measured costs and acceptance.

A block of K drafts is accepted token by token with probability alpha (a geometric model), so
one verifier pass yields E[N] = (1 - alpha^(K+1)) / (1 - alpha) tokens. Its cost:

- sequential: K draft calls, one more when the whole block was accepted (the draft then feeds
  its last draft and the bonus token one at a time), plus a verifier pass over K + 1 tokens and
  the host's own work per round (graph building, acceptance);
- pipelined: the drafter works while the verifier checks the block, continuing from its guess
  of the bonus token. When the whole block and the guess are right (probability alpha^(K+1))
  the next block is already drafted; otherwise its K drafts are made after the result, with the
  verifier idle. When the drafter is slower than the verifier, a hit still waits for the rest.

Costs are exponentially weighted averages of what the decoder measured, so they reflect the
machine as it is now (including two engines slowing each other down when they share cores).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Avg:
    """An exponentially weighted average that starts from its first observation."""

    decay: float
    value: float = 0.0
    n: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.n == 0 else self.decay * self.value + (1 - self.decay) * x
        self.n += 1


class CostModel:
    def __init__(self, decay: float = 0.9, alpha_prior: float = 0.6, prior_weight: float = 4.0):
        self.decay = decay
        self.draft = _Avg(decay)  # seconds per draft call
        self.host = _Avg(decay)  # seconds of host work per round outside the engines
        # verifier pass cost a + b * L by weighted least squares with forgetting
        self._s = [0.0] * 5  # sum w, w*L, w*L^2, w*t, w*L*t
        # verifier seconds per token when the drafter worked beside it, and when it did not:
        # on shared CPU cores the two slow each other down, on a Mac (ANE + GPU) hardly
        self.per_token_busy = _Avg(decay)
        self.per_token_alone = _Avg(decay)
        self._accepted = alpha_prior * prior_weight
        self._rejected = (1 - alpha_prior) * prior_weight

    # -- observations ------------------------------------------------------------------------

    def observe_draft(self, seconds: float) -> None:
        self.draft.add(seconds)

    def observe_host(self, seconds: float) -> None:
        self.host.add(seconds)

    def observe_verify(self, length: int, seconds: float) -> None:
        s = [x * self.decay for x in self._s]
        L = float(length)
        for i, v in enumerate((1.0, L, L * L, seconds, L * seconds)):
            s[i] += v
        self._s = s

    def observe_contention(self, length: int, seconds: float, busy: bool) -> None:
        (self.per_token_busy if busy else self.per_token_alone).add(seconds / max(length, 1))

    @property
    def contention(self) -> float:
        """How much longer a verifier pass takes while the drafter works (1.0: not at all)."""
        if not (self.per_token_busy.n and self.per_token_alone.n):
            return 1.0
        return max(self.per_token_busy.value / max(self.per_token_alone.value, 1e-12), 1.0)

    def prefetch_pays(self, k: int, k_next: int) -> bool:
        """Whether drafting ahead during a pass over k + 1 tokens is worth its contention: it
        saves the guess and k_next drafts when the block and the guess are right."""
        a = self.alpha
        saved = a ** (k + 1) * (k_next + 1) * self.draft.value
        return saved >= (self.contention - 1.0) * self.verify_seconds(k + 1)

    def observe_block(self, drafted: int, accepted: int) -> None:
        """A block's outcome: `accepted` successes and, if it stopped early, one failure."""
        if drafted == 0:
            return
        d = self.decay
        self._accepted = d * self._accepted + accepted
        self._rejected = d * self._rejected + (1 if accepted < drafted else 0)

    # -- estimates ---------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.draft.n >= 2 and self._s[0] > 0

    @property
    def alpha(self) -> float:
        return min(self._accepted / (self._accepted + self._rejected), 0.999)

    def verify_seconds(self, length: int) -> float:
        w, sl, sll, st, slt = self._s
        if w == 0:
            return 0.0
        var = sll / w - (sl / w) ** 2
        b = max((slt / w - (sl / w) * (st / w)) / var, 0.0) if var > 1e-12 else 0.0
        a = st / w - b * sl / w
        if a < 0:  # the fit says a pass is nearly free per call: keep it proportional
            a, b = 0.0, st / sl if sl else 0.0
        return a + b * length

    def tokens_per_round(self, k: int, alpha: float | None = None) -> float:
        a = self.alpha if alpha is None else alpha
        return (1 - a ** (k + 1)) / (1 - a)

    def round_seconds(self, k: int, pipelined: bool, alpha: float | None = None) -> float:
        a = self.alpha if alpha is None else alpha
        td, tv = self.draft.value, self.verify_seconds(k + 1)
        if not pipelined:
            return self.host.value + tv + k * td + (a**k) * td
        hit = a ** (k + 1)
        return self.host.value + tv + (1 - hit) * k * td + hit * max(0.0, (k + 1) * td - tv)

    def rate(self, k: int, pipelined: bool, alpha: float | None = None) -> float:
        """Expected tokens per second with blocks of k drafts."""
        t = self.round_seconds(k, pipelined, alpha)
        return self.tokens_per_round(k, alpha) / t if t > 0 else 0.0

    def best_k(self, pipelined: bool, k_max: int, default: int = 4) -> int:
        if not self.ready:
            return min(default, k_max)
        return max(range(1, max(k_max, 1) + 1), key=lambda k: self.rate(k, pipelined))
